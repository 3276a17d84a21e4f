//! Attaching: the source, its registrations, the arena and the first uploads, each undone in
//! reverse when a later one fails; binding parameters to the source's tensors.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ddo_arena::{Arena, ArenaError, UnitSpec};
use ddo_core::{Dtype, TensorSlice, UnitId, WeightSource};
use ddo_policy::ConversionSite;

use super::state::{Attached, Memory, SourceBytes};
use super::{ComponentSession, SessionRoute, UnitInfo, Weights};
use crate::SessionError;

impl ComponentSession {
    /// Attaches. Under `dtype_conversion=auto`, a budget without room for the staging buffers of
    /// conversion on the device converts at load on the host instead.
    pub(super) fn attach(&self) -> Result<Attached, SessionError> {
        let mut on_device = false;
        match self.attach_with(false, &mut on_device) {
            Err(SessionError::Capacity { .. })
                if on_device && self.plan.settings.dtype_conversion == ConversionSite::Auto =>
            {
                let mut attached = self.attach_with(true, &mut on_device)?;
                attached.host.staging_short = true;
                Ok(attached)
            }
            result => result,
        }
    }

    /// Attaches, converting at load on the host only when `host_only`; sets `on_device` when
    /// tensors were planned for conversion on the device.
    pub(super) fn attach_with(
        &self,
        host_only: bool,
        on_device: &mut bool,
    ) -> Result<Attached, SessionError> {
        let t = Instant::now();
        let p = &self.target.platform;
        let SourceBytes { source, ranges, mut host } = match &self.weights {
            Weights::Checkpoint { path, mmap } => self.checkpoint_source(path, *mmap, host_only)?,
            Weights::Host { storages, tensors, mmap } => {
                self.host_source(storages, tensors, *mmap)?
            }
        };
        host.stages.source_seconds = t.elapsed().as_secs_f64();
        *on_device = !host.device_conversions.is_empty();
        let slices = self.bind(source.slices(), &host.device_conversions)?;
        let specs = self.unit_specs(&*source);
        let budget = self.budget(source.slices(), &specs)?;
        // Register host bytes before the arena exists, so the first uploads run at link speed.
        let registrar = self.registrar(&ranges)?;
        let registering = Instant::now();
        let mut registered = Vec::new();
        if let Err(e) = self.register_all(ranges, &registrar, &mut registered, &mut host) {
            let cleanup = Self::unregister_all(&registrar, &mut registered);
            return Err(SessionError::Source(e).with_cleanup(cleanup));
        }
        host.stages.registration_seconds = registering.elapsed().as_secs_f64();
        let priming = Instant::now();
        let arena = match Arena::with_conversions(
            p,
            source.clone(),
            &specs,
            budget,
            &host.device_conversions,
        ) {
            Ok(a) => a,
            Err(e) => {
                let cleanup = Self::unregister_all(&registrar, &mut registered);
                return Err(self.arena_error(e).with_cleanup(cleanup));
            }
        };
        // The first pass starts warm; resident weights are on the device before the host uses
        // the component (a method called outside forward reads them without acquiring).
        if let Err(e) = arena.prime().and_then(|_| arena.settle_resident()) {
            // Registrations go only after the arena's copies are proven complete (closed).
            let cleanup = arena
                .close()
                .map_err(SessionError::Arena)
                .and_then(|()| Self::unregister_all(&registrar, &mut registered));
            return Err(SessionError::Arena(e).with_cleanup(cleanup));
        }
        host.stages.resident_seconds = priming.elapsed().as_secs_f64();
        self.fill_peer_store(&arena, &mut host);
        let plan = arena.plan();
        let units = specs
            .iter()
            .enumerate()
            .map(|(i, u)| UnitInfo {
                id: UnitId(i as u32),
                name: u.name.clone(),
                pinned: u.pinned,
                resident: plan.resident[i],
            })
            .collect();
        let total_bytes = arena.layout().payload();
        Ok(Attached {
            memory: Arc::new(Memory { arena, registrar, registered: Mutex::new(registered) }),
            source,
            units,
            slices,
            leases: HashMap::new(),
            next_lease: 1,
            pass: Vec::new(),
            host,
            setup_seconds: t.elapsed().as_secs_f64(),
            total_bytes,
            tensor_count: self.assignment.parameters.len() as u64,
            earlier: ddo_arena::ArenaStats::default(),
        })
    }

    pub(super) fn arena_error(&self, e: ArenaError) -> SessionError {
        match e.original() {
            ArenaError::BudgetTooSmall { .. } => SessionError::Capacity {
                setting: match self.route {
                    SessionRoute::Native | SessionRoute::Disk => {
                        "vmm_resident_weight_budget_gb / --ddo-vmm-resident-weight-budget-gb"
                    }
                    SessionRoute::Linear => {
                        "auto_vram_headroom_gb lower, or resident_module_budget_gb higher"
                    }
                },
                message: e.original().to_string(),
            },
            _ => SessionError::Arena(e),
        }
    }

    /// Every parameter name -> the source's slice; checks declared dtypes and shapes.
    pub(super) fn bind(
        &self,
        slices: &[TensorSlice],
        on_device: &HashMap<usize, Dtype>,
    ) -> Result<HashMap<String, usize>, SessionError> {
        let index: HashMap<&str, usize> =
            slices.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let what = match self.weights {
            Weights::Checkpoint { .. } => "the checkpoint",
            Weights::Host { .. } => "the host tensors",
        };
        let mut out = HashMap::new();
        for p in &self.assignment.parameters {
            let Some(&i) = p.names.iter().find_map(|n| index.get(n.as_str())) else {
                return Err(SessionError::Weights(format!(
                    "parameter {} has no tensor in {what}; route {} streams every weight from it",
                    p.names[0],
                    self.route.name()
                )));
            };
            let t = &slices[i];
            let served = on_device.get(&i).copied().unwrap_or(t.dtype);
            let dtype_differs = p.dtype.is_some_and(|d| d != served);
            let shape_differs = p.shape.as_ref().is_some_and(|s| *s != t.shape);
            if (dtype_differs || shape_differs) && !views_bytes(p.dtype, p.shape.as_deref(), t) {
                let hint = if shape_differs {
                    "the checkpoint is not this model's"
                } else {
                    "ddo converts between F32, F16 and BF16 and widens fp8 to them; load the model with torch_dtype matching the checkpoint"
                };
                return Err(SessionError::Weights(format!(
                    "parameter {} is {} {:?} but {what} stores {} {:?}; {hint}",
                    p.names[0],
                    p.dtype.map_or("?", Dtype::as_str),
                    p.shape.clone().unwrap_or_default(),
                    t.dtype.as_str(),
                    t.shape
                )));
            }
            for n in &p.names {
                out.insert(n.clone(), i);
            }
        }
        refuse_unbound_scales(slices, &out)?;
        Ok(out)
    }

    /// The arena's units: the resident rest (pinned, first) and one per streamed block.
    pub(super) fn unit_specs(&self, source: &dyn WeightSource) -> Vec<UnitSpec> {
        self.assignment.unit_specs(source.slices())
    }
}

/// Whether a `U8` parameter of `shape` holds `t`'s bytes as rows of bytes (a quantized
/// framework parameter, such as a GGUF block tensor, over a tensor its file types otherwise):
/// same leading dimensions, last dimension in bytes.
fn views_bytes(dtype: Option<Dtype>, shape: Option<&[u64]>, t: &TensorSlice) -> bool {
    let (Some(Dtype::U8), Some(shape)) = (dtype, shape) else { return false };
    let (Some((&last, lead)), Some((&t_last, t_lead))) = (shape.split_last(), t.shape.split_last())
    else {
        return false;
    };
    lead == t_lead && t_last.checked_mul(t.dtype.size_bytes()) == Some(last)
}

/// Refuses an fp8 checkpoint with scale tensors no parameter takes ("scaled fp8"): its fp8
/// weights mean `weight * scale`, and serving them without their scales would be silently wrong.
fn refuse_unbound_scales(
    slices: &[TensorSlice],
    bound: &HashMap<String, usize>,
) -> Result<(), SessionError> {
    let fp8 = |t: &TensorSlice| matches!(t.dtype, Dtype::F8E4M3 | Dtype::F8E5M2);
    if !slices.iter().any(fp8) {
        return Ok(());
    }
    let used: std::collections::HashSet<usize> = bound.values().copied().collect();
    // `scale_weight` / `scaled_fp8` (ComfyUI), `weight_scale` / `input_scale` (compressed
    // tensors, ModelOpt), `weight_scale_inv` (block-scaled fp8): any scale no parameter takes.
    let scale = slices.iter().enumerate().find(|(i, t)| {
        let leaf = t.name.rsplit('.').next().unwrap_or(&t.name).to_ascii_lowercase();
        !used.contains(i) && leaf.contains("scale")
    });
    match scale {
        Some((_, t)) => Err(SessionError::Weights(format!(
            "the checkpoint holds fp8 weights with scale tensors ({}) that no parameter of the module takes: \
             its weights are meant to be multiplied by them, so ddo refuses to serve them unscaled; \
             use a checkpoint without scales (or dequantize it to bf16), or a module that declares the scales",
            t.name
        ))),
        None => Ok(()),
    }
}
