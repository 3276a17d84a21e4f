//! Prints a checkpoint's tensors (name, dtype, shape, bytes, file) and totals, or the error.
//!
//! ```sh
//! cargo run -p ddo-source --example inspect -- PATH
//! ```
//!
//! PATH is a safetensors file, a `*.safetensors.index.json`, or a model folder. Exits 1 on an
//! invalid checkpoint, 2 on bad usage.

use std::process::ExitCode;

use ddo_core::ByteSize;
use ddo_source::Checkpoint;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path] = args.as_slice() else {
        eprintln!("usage: inspect PATH   (a .safetensors file, an index .json, or a model folder)");
        return ExitCode::from(2);
    };
    let opened = if path.ends_with(".index.json") {
        Checkpoint::open_index(path)
    } else {
        Checkpoint::open(path)
    };
    let checkpoint = match opened {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let width = checkpoint.slices().iter().map(|s| s.name.len()).max().unwrap_or(4).max(4);
    println!("{:<width$}  {:<7}  {:<20}  {:>12}  file", "name", "dtype", "shape", "bytes");
    for s in checkpoint.slices() {
        let file = s.path.file_name().map(|f| f.to_string_lossy()).unwrap_or_default();
        let shape = format!("{:?}", s.shape);
        println!(
            "{:<width$}  {:<7}  {:<20}  {:>12}  {file}",
            s.name,
            s.dtype.as_str(),
            shape,
            s.len
        );
    }
    println!(
        "{} tensors in {} file(s), {} ({} bytes)",
        checkpoint.slices().len(),
        checkpoint.files().len(),
        ByteSize(checkpoint.total_bytes()),
        checkpoint.total_bytes()
    );
    ExitCode::SUCCESS
}
