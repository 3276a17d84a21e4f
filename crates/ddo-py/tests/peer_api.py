"""The published library's public surface (diffusers-dynamic-offloader 0.1.0rc2), written down as
stubs: every public name with its parameters and defaults, the attributes of its result and
settings types, its config fields and its CLI flags. ``test_peer_api.py`` compares ddo against
this description mechanically. The stubs hold no behaviour; only their signatures matter.

Signatures follow the published 0.1.0rc2 package where the reference description
(``peer-api.md``) leaves parameters out or names them differently: the hook's Diffusers
lifecycle, the legacy weight store, ``resolve_dynamic_offload_preset(requested_preset)``,
``maybe_purge_windows_standby_cache``'s keywords, the state's ``byte_count``,
``preset_bool``'s default and the constructors' defaults."""

# ruff: noqa: ARG001
from __future__ import annotations

import torch

MIB = 1 << 20
LINEAR_EMBEDDING = (torch.nn.Linear, torch.nn.Embedding)
PHASES = ("before_run", "after_text_encoder", "before_transformer", "after_run")


# Entry points.
def enable_offload(module, *, settings=None, config=None, component="model", preset="auto", route=None,
                   group_offload=None, dynamic_offload=None, offload_type=None, use_stream=None, record_stream=None,
                   group_low_cpu_mem_usage=None, num_blocks_per_group=None, execution_device="cuda:0",
                   offload_device="cpu", low_cpu_mem_usage=True, running_on_wsl=None, environ=None,
                   use_environment=True, apply_hook=True, record_event=None, dynamic_event_name=None,
                   group_event_name=None, **config_overrides): ...
def enable_pipeline_offload(pipeline, *, settings=None, components=None, preset="auto", execution_device="cuda:0",
                            offload_device="cpu", low_cpu_mem_usage=True, running_on_wsl=None, environ=None,
                            use_environment=True, apply_hook=True, record_event=None, **config_overrides): ...
def enable_dynamic_offload(module, *, component="model", settings=None, config=None, preset="auto",
                           execution_device="cuda:0", offload_device="cpu", target_module_classes=LINEAR_EMBEDDING,
                           skip_modules_pattern=(), always_resident_modules_pattern=None, running_on_wsl=None,
                           environ=None, use_environment=True, apply_hook=True, record_event=None,
                           event_name="setup_dynamic_offload", **config_overrides): ...
def enable_diffusers_group_offload(module, *, onload_device="cuda:0", offload_device="cpu", offload_type="leaf_level",
                                   use_stream=True, record_stream=False, low_cpu_mem_usage=True,
                                   num_blocks_per_group=1, apply_hook=True, record_event=None,
                                   event_name="setup_diffusers_group_offload"): ...
def apply_dynamic_offload(module, config=None): ...
def from_pretrained_with_dynamic_offload(pretrained_model_name_or_path, *, model_loader=None,
                                         dynamic_offload_config=None, apply_dynamic=False, profile_name=None,
                                         build_profile=None, **from_pretrained_kwargs): ...
def remove_dynamic_offload(module, recurse=True): ...
def get_dynamic_offload_state(module): ...
def detect_quantized_backend_modules(module): ...
def build_dynamic_offload_event_payload(settings, state, config=None): ...
def clear_dynamic_offload_plan_cache(): ...
def clear_dynamic_offload_pinned_tensor_cache(): ...


# Settings and the environment. The four device and module keywords are required, as the reference
# description lists them (the 0.1.0rc2 package gives them the defaults "cuda:0", "cpu",
# (Linear, Embedding) and ()).
def load_dynamic_offload_settings_from_env(*, execution_device="cuda:0", offload_device="cpu",
                                           target_module_classes=LINEAR_EMBEDDING, skip_modules_pattern=(),
                                           always_resident_modules_pattern=None,
                                           running_on_wsl=None, environ=None, default_preset="",
                                           component_policies=None): ...
def dynamic_offload_env_value(name, default="", environ=None): ...
def dynamic_offload_preset_env_value(name, default="", *, requested_preset="", effective_preset=None,
                                     running_on_wsl=None, environ=None): ...
def resolve_dynamic_offload_preset(requested_preset, *, running_on_wsl=None): ...
def get_dynamic_offload_presets(): ...
def format_dynamic_offload_presets(*, default_preset="auto", running_on_wsl=None): ...
def is_wsl_environment(): ...
def get_available_system_ram_gb(): ...
def purge_windows_standby_cache(): ...
def purge_windows_standby_cache_event(record_event, name, print_message=True): ...
def maybe_purge_windows_standby_cache(settings_or_phase=None, phase=None, *, settings=None, preset="auto",
                                      execution_device="cuda:0", offload_device="cpu", running_on_wsl=None,
                                      record_event=None, event_name=None, default="0", print_message=True,
                                      ignore_errors=True, environ=None, enabled=None): ...


# Backend and CLI.
def resolve_dynamic_offload_backend(backend="linear", preset="auto", *, running_on_wsl=None): ...
def add_dynamic_offload_arguments(parser): ...
def add_dynamic_offload_lifecycle_arguments(parser, phases=PHASES): ...


# Memory and phase helpers.
def inspect_host_memory(module=None, *, phase="", max_storage_samples=16): ...
def release_pytorch_host_cache(*, enabled=False, phase="", device=None): ...
def release_native_vmm_idle_cache(*, enabled=False, phase="", device=None, clear_cublas_workspaces=False): ...
def inspect_vmm_component(module, *, component="model", module_pattern=".*"): ...


# Capacity profiles.
def get_dynamic_offload_profile_dir(profile_dir=None): ...


FUNCTIONS = [
    name for name, value in list(globals().items())
    if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == __name__
    and not isinstance(value, type)
]

# Names that are values, not callables.
CONSTANTS = ["DDO_PRESETS", "DYNAMIC_OFFLOAD_PROFILE_SCHEMA_VERSION"]

# Public callables that must exist and accept these leading parameters (their full parameter lists
# are compared above too).
PARTLY_DESCRIBED = {
    "maybe_purge_windows_standby_cache": ("settings_or_phase", "phase"),
}

# The capacity-profile module's public names (``ddo.profiles``).
PROFILE_FUNCTIONS = [
    "get_dynamic_offload_profile_dir", "dynamic_offload_profile_key", "dynamic_offload_profile_path",
    "load_dynamic_offload_profile", "record_dynamic_offload_profile", "get_dynamic_offload_profile_capacity",
    "get_dynamic_offload_profile_recommendation", "normalize_dynamic_offload_profile_context",
    "DynamicOffloadProfileSession",
]


# The capacity-profile module's functions (``ddo.profiles``), with their parameters.
class profile_functions:  # noqa: N801 - a namespace
    def get_dynamic_offload_profile_dir(profile_dir=None): ...
    def normalize_dynamic_offload_profile_context(context): ...
    def dynamic_offload_profile_key(context): ...
    def dynamic_offload_profile_path(context, profile_dir=None): ...
    def load_dynamic_offload_profile(context, profile_dir=None): ...
    def record_dynamic_offload_profile(context, observation, profile_dir=None, recommendation=None): ...
    def get_dynamic_offload_profile_capacity(profile, metric): ...
    def get_dynamic_offload_profile_recommendation(profile): ...


# Methods of the published profile session.
class DynamicOffloadProfileSession:
    ATTRIBUTES = ("execution_context", "capacity_context", "profile_dir", "execution_profile", "capacity_profile")
    def apply_settings(self, settings, *, allow_recommendation=True): ...
    def recommend_resident_budget(total_vram_gb, peak_vram_gb, headroom_gb): ...
    def record_success(self, observation, recommendation=None): ...


# Constructors of published types: parameter names and kinds (defaults are not published).
class constructors:  # noqa: N801 - a namespace
    def DynamicOffloadExecutionTimer(enabled, device, native_factory, diagnostic_step_wait): ...
    def DynamicOffloadProfileSession(execution_context, capacity_context, profile_dir): ...
    def DynamicOffloadHook(config): ...
    def DynamicOffloadMetrics(route, configuration, setup, runtime): ...
    def DynamicOffloadPlanEntry(module_name, module_type, tensor_name, shape, dtype, device, bytes, placement): ...
    def VmmWeightStore(device_id, max_resident_bytes): ...
    def VmmWeightLease(store, slot, tensor): ...
    def VmmWeightStoreStats(reserved_bytes, resident_bytes, materializations, evictions, copied_bytes): ...


CONSTRUCTORS = [name for name in vars(constructors) if not name.startswith("_")]

# The published defaults of constructor parameters (the published timer takes its parameters by
# keyword only; ddo's also takes them by position).
CONSTRUCTOR_DEFAULTS = {
    "DynamicOffloadExecutionTimer": {"enabled": False, "device": "cuda", "native_factory": None,
                                     "diagnostic_step_wait": False},
    "DynamicOffloadProfileSession": {"profile_dir": None},
    "VmmWeightStore": {"device_id": 0, "max_resident_bytes": 0},
    "VmmWeightStoreStats": {"reserved_bytes": 0, "resident_bytes": 0, "materializations": 0, "evictions": 0,
                            "copied_bytes": 0},
}

# Types and what hosts read from them: (attributes, {method: stub}).
class DynamicOffloadApplyResult:
    ATTRIBUTES = ("module", "hook", "settings", "should_move_to_execution_device", "event_payload", "route")
    def metrics_snapshot(self, *, collect_completed=False, execution_timing=None): ...
    def cleanup_on_error(self): ...
    def detach_auxiliary_cpu_sources(self, *, enabled=False, max_copy_bytes=16 * MIB): ...
    def profile_run(self): ...
    def execution_timer(self, *, enabled=False, native_units=False, native_capacity=4096,
                        diagnostic_step_wait=False): ...
    def metrics_journal(self, directory, *, enabled=False): ...
    def allocation_diagnostics(self, *, enabled=False): ...
    def operator_diagnostics(self, *, enabled=False, module_path=None, invocations=(0, 2), output_dir=None,
                             use_cuda=True): ...


class DynamicOffloadLoadResult:
    ATTRIBUTES = ("module", "hook", "should_move_to_execution_device")
    def metrics_snapshot(self): ...
    def inspect_vmm_component(self, *, component="model", buffer_limit_bytes=1 * MIB): ...
    def profile_run(self): ...


class DiffusersGroupOffloadResult:
    ATTRIBUTES = ("module", "event_payload")


class DynamicOffloadSettings:
    ATTRIBUTES = ("requested_preset", "effective_preset", "enabled", "plan", "config", "requested_pin_cpu_memory",
                  "effective_pin_cpu_memory", "disable_pin_on_wsl", "running_on_wsl", "component_policies",
                  "execution_mode")
    def preset_value(self, name, default="", environ=None): ...
    def preset_bool(self, name, default="0", environ=None): ...
    def as_metrics(self): ...


class DynamicOffloadBackend:
    ATTRIBUTES = ("backend", "requested_preset", "effective_preset", "execution_mode", "requires_native_bootstrap")
    def build_config(self, **overrides): ...
    def build_config_from_args(self, args): ...


class DynamicOffloadMetrics:
    ATTRIBUTES = ("route", "configuration", "setup", "runtime", "schema_version")
    def as_dict(self): ...
    def format_profile(self): ...


class DynamicOffloadPlanEntry:
    ATTRIBUTES = ("module_name", "module_type", "tensor_name", "shape", "dtype", "device", "bytes", "placement")


# The execution timer (``result.execution_timer()``): single use, ``with timer:`` around the loop.
class DynamicOffloadExecutionTimer:
    ATTRIBUTES = ()
    def mark_step(self): ...
    def snapshot(self, *, wait=False): ...
    def attach(self, report): ...


# The state get_dynamic_offload_state returns (and the hook's ``state``).
class DynamicOffloadState:
    ATTRIBUTES = ("entries", "module_count", "total_bytes", "bytes_by_placement", "setup_seconds_by_action",
                  "setup_bytes_by_action", "copy_seconds_by_name", "copy_bytes_by_name", "copy_calls_by_name",
                  "patched_module_count", "selected_resident_modules", "selected_resident_linear_weights",
                  "selected_pinned_linear_weights", "resolved_resident_module_patterns", "sdnq_pinned_parameter_bytes",
                  "sdnq_pinned_parameter_count", "sdnq_unpinned_parameter_bytes", "sdnq_unpinned_parameter_count",
                  "planner_decisions")
    def add_setup(self, action, seconds, byte_count=0): ...
    def add_copy(self, name, seconds, byte_count): ...
    def clone_for_runtime(self): ...
    def as_dict(self): ...


# The hook (``result.hook``), a Diffusers ModelHook in the published library: its lifecycle
# (``post_forward`` and ``reset_state`` as ModelHook defines them; ``deinitalize_hook`` is the
# published spelling).
class DynamicOffloadHook:
    ATTRIBUTES = ("config", "state", "execution_device", "offload_device", "execution_mode")
    def initialize_hook(self, module): ...
    def pre_forward(self, module, *args, **kwargs): ...
    def post_forward(self, module, output): ...
    def detach_hook(self, module): ...
    def deinitalize_hook(self, module): ...
    def reset_state(self, module): ...
    def vmm_runtime_stats(self): ...
    def collect_completed_runtime_resources(self): ...
    def print_profile_summary(self, top_n=8): ...


# The legacy cuda-python weight store (ddo refuses each member with what it does instead).
class VmmWeightStore:
    ATTRIBUTES = ("stats",)
    def reserve(self, key, size_bytes): ...
    def acquire(self, key, source, *, stream=None): ...
    def release(self, key): ...
    def evict(self, key): ...
    def close(self): ...


class VmmWeightStoreStats:
    ATTRIBUTES = ("reserved_bytes", "resident_bytes", "materializations", "evictions", "copied_bytes")


CLASSES = [DynamicOffloadApplyResult, DynamicOffloadLoadResult, DiffusersGroupOffloadResult, DynamicOffloadSettings,
           DynamicOffloadBackend, DynamicOffloadMetrics, DynamicOffloadPlanEntry, DynamicOffloadExecutionTimer,
           DynamicOffloadState, DynamicOffloadHook, VmmWeightStore, VmmWeightStoreStats]

# Other public types: constructible, or refused with what ddo does instead.
OTHER_TYPES = ["DynamicOffloadConfig", "DynamicOffloadState", "DynamicOffloadHook", "DynamicOffloadExecutionTimer",
               "VmmWeightStore", "VmmWeightLease", "VmmWeightStoreStats"]

# Every field of DynamicOffloadConfig with its dataclass default (the internal
# `_profile_budget_applied` aside).
CONFIG_DEFAULTS = {
    "execution_device": "cuda:0",
    "offload_device": "cpu",
    "target_module_classes": LINEAR_EMBEDDING,
    "skip_modules_pattern": (),
    "always_resident_modules_pattern": (),
    "small_tensor_threshold_bytes": 16 * 1024,
    "execution_mode": "plan",
    "linear_runtime_strategy": "functional",
    "linear_convolution_offload": False,
    "vmm_resident_weight_budget_gb": 0.0,
    "vmm_staging_buffer_gb": 0.625,
    "vmm_windows_file_read_chunk_mb": 2,
    "vmm_virtual_host_transport": False,
    "vmm_native_transport": False,
    "vmm_source_cache_gb": 0.0,
    "vmm_source_registered_gb": 0.0,
    "vmm_module_pattern": ".*",
    "vmm_component_tensor_ownership": False,
    "vmm_float8_weight_only": False,
    "vmm_execution_auxiliary_ownership": False,
    "vmm_component_buffer_limit_mb": 1,
    "vmm_page_mb": 0,
    "vmm_dxgi_local_headroom_gb": 0.0,
    "vmm_dxgi_shared_headroom_gb": 0.0,
    "vmm_dxgi_system_headroom_gb": 0.0,
    "vmm_host_cache_gb": 0.0,
    "vmm_native_source_cache_slot_mb": 0,
    "vmm_native_source_cache_slots": 0,
    "vmm_pin_source_weights": False,
    "vmm_fault_fallback": False,
    "vmm_execution_backing_reclaim": False,
    "pin_cpu_memory": False,
    "allow_pin_memory_fallback": True,
    "pin_cpu_workers": 1,
    "cache_plan": True,
    "cache_pinned_weights": False,
    "pinned_weight_cache_namespace": "",
    "auto_budget_policy": "off",
    "max_resident_module_budget_gb": 6.0,
    "auto_vram_headroom_gb": 0.0,
    "profile_vram_headroom_gb": 1.0,
    "profile_name": "",
    "build_profile": False,
    "auto_full_pin_min_model_to_vram_ratio": 4.0,
    "profile_resident_module_budget_gb": 0.0,
    "max_pin_weight_budget_gb": 0.0,
    "available_system_ram_gb": 0.0,
    "system_ram_headroom_gb": 6.0,
    "pin_weight_budget_gb": 0.0,
    "pin_weight_budget_ratio": 0.0,
    "pin_weight_selection": "spread",
    "resident_module_budget_gb": 0.0,
    "resident_module_patterns": (),
    "resident_module_selection": "spread",
    "load_safetensors_backend": "",
    "verbose": False,
    "show_profile": True,
}
CONFIG_FIELDS = list(CONFIG_DEFAULTS)

# add_dynamic_offload_arguments: flag -> default (None for switches and unset values).
CLI_FLAGS = {
    "--ddo-backend": "linear",
    "--ddo-preset": "auto",
    "--ddo-vmm-resident-weight-budget-gb": 4.0,
    "--ddo-vmm-total-staging-gb": None,
    "--ddo-vmm-staging-buffer-gb": 0.625,
    "--ddo-vmm-native-transport": False,
    "--ddo-vmm-native-source-cache-slot-mb": 0,
    "--ddo-vmm-native-source-cache-slots": 0,
    "--ddo-vmm-source-cache-gb": 0.0,
    "--ddo-vmm-source-registered-gb": 0.0,
    "--ddo-vmm-component-tensor-ownership": False,
    "--ddo-vmm-execution-auxiliary-ownership": False,
    "--ddo-vmm-component-buffer-limit-mb": 1,
    "--show-profile": False,
    "--show-metrics": False,
}

# The bootstrap module hosts import before CUDA starts.
class ddo_vmm_bootstrap:  # noqa: N801 - the module's name
    def vmm_fast_requested(argv=None, *, default_backend="linear"): ...
    def ensure_vmm_fast_process(*, library_path=None, allocator_cache_mib=512, argv=None, environ=None): ...
