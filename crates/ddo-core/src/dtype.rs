//! Element types of checkpoint tensors.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor, named as safetensors names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum Dtype {
    #[serde(rename = "BOOL")]
    Bool,
    U8,
    I8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F16,
    BF16,
    F32,
    F64,
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
}

impl Dtype {
    /// Every dtype ddo accepts, in the order of [`Dtype::as_str`]'s documentation.
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::I16,
        Dtype::U16,
        Dtype::I32,
        Dtype::U32,
        Dtype::I64,
        Dtype::U64,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F32,
        Dtype::F64,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
    ];

    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// The safetensors name (`"BF16"`, `"F8_E4M3"`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
        }
    }

    /// PyTorch's name of the element type (`bfloat16`, `float8_e4m3fn`), as `torch.<name>`
    /// spells it: the inverse of [`from_torch`](Dtype::from_torch).
    pub const fn torch_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::I16 => "int16",
            Dtype::U16 => "uint16",
            Dtype::I32 => "int32",
            Dtype::U32 => "uint32",
            Dtype::I64 => "int64",
            Dtype::U64 => "uint64",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::F8E4M3 => "float8_e4m3fn",
            Dtype::F8E5M2 => "float8_e5m2",
        }
    }

    /// The element type PyTorch names `name` (`torch.bfloat16`, `bfloat16`, `half`, ...), where
    /// ddo has one; `None` for a dtype ddo does not hold (complex, quantized, ...).
    pub fn from_torch(name: &str) -> Option<Dtype> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        Some(match name {
            "bfloat16" => Dtype::BF16,
            "float16" | "half" => Dtype::F16,
            "float32" | "float" => Dtype::F32,
            "float64" | "double" => Dtype::F64,
            "int64" | "long" => Dtype::I64,
            "int32" | "int" => Dtype::I32,
            "int16" | "short" => Dtype::I16,
            "int8" => Dtype::I8,
            "uint8" => Dtype::U8,
            "bool" => Dtype::Bool,
            "uint16" => Dtype::U16,
            "uint32" => Dtype::U32,
            "uint64" => Dtype::U64,
            "float8_e4m3fn" => Dtype::F8E4M3,
            "float8_e5m2" => Dtype::F8E5M2,
            _ => return None,
        })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of parsing an unknown dtype name; it lists the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {name:?}; known dtypes: {}", Dtype::ALL.iter().map(|d| d.as_str()).collect::<Vec<_>>().join(", "))]
pub struct UnknownDtype {
    /// The name that was not recognised.
    pub name: String,
}

impl FromStr for Dtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| UnknownDtype { name: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes() {
        for d in Dtype::ALL {
            assert_eq!(d.as_str().parse::<Dtype>(), Ok(d));
        }
        assert_eq!(Dtype::BF16.size_bytes(), 2);
        assert_eq!(Dtype::F8E4M3.size_bytes(), 1);
        let err = "F4".parse::<Dtype>().unwrap_err();
        assert!(err.to_string().starts_with("unknown dtype \"F4\"; known dtypes: BOOL, U8"));
    }

    #[test]
    fn torch_dtype_names() {
        assert_eq!(Dtype::from_torch("torch.bfloat16"), Some(Dtype::BF16));
        for dtype in Dtype::ALL {
            assert_eq!(Dtype::from_torch(dtype.torch_name()), Some(dtype), "{dtype}");
        }
        assert_eq!(Dtype::from_torch("float32"), Some(Dtype::F32));
        assert_eq!(Dtype::from_torch("torch.complex64"), None);
    }
}
