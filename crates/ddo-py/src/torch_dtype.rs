//! PyTorch's names of element types, where Python strings meet `ddo_session::core::Dtype`.

use ddo_session::core::Dtype;

/// The PyTorch name of `dtype` (`bfloat16`, `float8_e4m3fn`), as `torch.<name>` spells it.
pub(crate) const fn torch_name(dtype: Dtype) -> &'static str {
    match dtype {
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
