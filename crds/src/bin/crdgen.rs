//! Prints the StreamJob CRD manifest: `cargo run -p weir-api --bin crdgen > crds/streamjob.yaml`.

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let yaml = match weir_api::streamjob::crd_yaml() {
        Ok(y) => y,
        Err(e) => {
            eprintln!("crdgen: cannot render the CRD: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A closed pipe (e.g. `| head`) is not worth a panic.
    match std::io::stdout().write_all(yaml.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crdgen: {e}");
            ExitCode::FAILURE
        }
    }
}
