//! Which device a plan runs on.

use ddo_policy::{Origin, Plan};
use ddo_session::{ExecutionDevice, SessionError};

/// The device for an `execution_device` setting: as given, except that a default `cuda` on a
/// machine without a CUDA driver runs on the host backend (the user asked for nothing in
/// particular). The error names the setting.
pub fn choose_device(value: &str, from_default: bool) -> Result<ExecutionDevice, SessionError> {
    let device = ExecutionDevice::parse(value)?;
    if from_default
        && matches!(device, ExecutionDevice::Cuda(_))
        && !ddo_platform::cuda::driver_present()
    {
        return Ok(ExecutionDevice::Host);
    }
    Ok(device)
}

/// The device `plan` runs on: its `execution_device`, chosen as [`choose_device`] does (the
/// setting counts as a default when no one set it).
pub fn plan_device(plan: &Plan) -> Result<ExecutionDevice, SessionError> {
    let from_default = matches!(plan.origins.get("execution_device"), Some(Origin::Default) | None);
    choose_device(&plan.settings.execution_device, from_default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_chosen_as_named() {
        assert_eq!(choose_device("cpu", true).unwrap(), ExecutionDevice::Host);
        assert_eq!(choose_device("cpu", false).unwrap(), ExecutionDevice::Host);
        let err = choose_device("abc", true).unwrap_err().to_string();
        assert_eq!(err, "execution_device: \"abc\" is not a device; use cuda, cuda:N or cpu");
    }

    #[test]
    fn an_explicit_cuda_device_is_kept() {
        // Without a driver the explicit choice fails later, when the device is opened.
        assert_eq!(choose_device("cuda:0", false).unwrap(), ExecutionDevice::Cuda(0));
    }

    #[test]
    fn a_default_cuda_without_a_driver_runs_on_the_host() {
        let want = if ddo_platform::cuda::driver_present() {
            ExecutionDevice::Cuda(0)
        } else {
            ExecutionDevice::Host
        };
        assert_eq!(choose_device("cuda", true).unwrap(), want);
    }
}
