"""Entropy-coded streaming (``vmm_weight_encoding``) under hostile use: bf16 and fp16 weights held
encoded in host memory and decoded after each upload (on the CPU, on the host backend) give the
resident model's outputs bit for bit whatever the user does around them, and every test checks
that tensors really were encoded and decoded."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import threading

import pytest
import torch

import ddo
from conftest import seeded

# A streamed weight (256 x 1024) that stays encoded with every 16-bit pattern in it.
PATTERNS = "single_transformer_blocks.0.proj_mlp.weight"
# A streamed weight (256 x 256) given NaN, infinities and the largest values.
SPECIALS = "single_transformer_blocks.1.attn.to_q.weight"
# A streamed weight held encoded, and a small one served as its own bytes (its encoding would
# not be smaller: each carries an 8 KiB table).
ENCODED = "transformer_blocks.0.ff.net.0.proj.weight"
RAW = "transformer_blocks.0.attn.norm_q.weight"


def gib(text):
    """``"22.00 MiB"`` (as errors give sizes) in GiB."""
    number, unit = text.split()
    return float(number) * {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0}[unit]


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def same_bits(a, b):
    """Equal bit for bit (16-bit dtypes), so NaN payloads and -0 count too."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Saved:
    """A tiny Flux transformer saved in ``dtype`` (inner dim 256: its matrices are 128 to 640
    KiB, large enough to be encoded), its inputs, and the tensors of its file and the outputs of
    the model Diffusers loads from it."""

    def __init__(self, root, dtype):
        from diffusers import FluxTransformer2DModel

        seeded(11)
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=128,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[32, 48, 48],
        )
        self.path = root / "model"
        model.to(dtype).save_pretrained(self.path)
        self.dtype = dtype
        seeded(12)
        self.inputs = dict(
            hidden_states=torch.randn(1, 16, 4, dtype=dtype),
            encoder_hidden_states=torch.randn(1, 8, 32, dtype=dtype),
            pooled_projections=torch.randn(1, 32, dtype=dtype),
            timestep=torch.tensor([0.5], dtype=dtype),
            img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(8, 3),
            return_dict=False,
        )
        self._read()

    @property
    def file(self):
        return self.path / "diffusion_pytorch_model.safetensors"

    def _read(self):
        from safetensors.torch import load_file

        self.tensors = load_file(self.file)
        self.reference = self.resident_output()

    def resident_output(self):
        """The outputs of the model Diffusers loads from the file as it is now."""
        from diffusers import FluxTransformer2DModel

        return run(FluxTransformer2DModel.from_pretrained(self.path, torch_dtype=self.dtype).eval(), self.inputs)

    def copy(self, folder, edit=None):
        """The same model in ``folder``, its tensors changed by ``edit(tensors)`` first."""
        from safetensors.torch import save_file

        other = object.__new__(Saved)
        other.__dict__.update(self.__dict__)
        other.path = folder / "model"
        shutil.copytree(self.path, other.path)
        if edit is not None:
            other.__dict__.pop("budget_gb", None)  # its encodings' sizes may differ
            tensors = dict(self.tensors)
            edit(tensors)
            save_file(tensors, other.file, metadata={"format": "pt"})
            other._read()
        return other

    @functools.cached_property
    def budget_gb(self):
        """The smallest GPU budget that works, as the refusal of a smaller one names it: the
        resident rest, two slots and the staging buffers of the encodings, so every block
        streams."""
        with pytest.raises(ddo.DynamicOffloadCapacityError, match="raise the budget to") as raised:
            self.load(vmm_resident_weight_budget_gb=1 / 1024)
        return gib(str(raised.value).split("raise the budget to ")[1].split(" or more")[0])

    def load(self, **settings):
        values = dict(
            backend="vmm",
            execution_device="cpu",
            prefetch_depth=1,
            vmm_weight_encoding="on",
        )
        if "vmm_resident_weight_budget_gb" not in settings:
            values["vmm_resident_weight_budget_gb"] = self.budget_gb
        config = ddo.DynamicOffloadConfig(**{**values, **settings})
        return ddo.from_pretrained_with_dynamic_offload(
            self.path, apply_dynamic=True, dynamic_offload_config=config, torch_dtype=self.dtype
        )


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return Saved(tmp_path_factory.mktemp("bf16"), torch.bfloat16)


def counters(loaded):
    m = loaded.offload.metrics_snapshot(collect_completed=True).as_dict()
    return m["setup"], m["runtime"]


def assert_streamed_encoded(loaded):
    """Tensors really were held encoded, every block streamed, and uploads were decoded."""
    setup, runtime = counters(loaded)
    assert setup["weight_encoding"].startswith("on"), setup
    assert setup["encoded_tensors"] > 0 and setup["encoded_bytes"] < 0.95 * setup["encoding_source_bytes"], setup
    assert setup["streamed_units"] == 4 and setup["execution_slots"] == 2, setup
    assert runtime["device_decodes"] > 0 and runtime["decoded_bytes"] > runtime["encoded_upload_bytes"], runtime
    return setup, runtime


def assert_refused_until_reloaded(loaded, inputs):
    """A changed checkpoint is refused by forwards and by placeholder reads alike, every time."""
    for _ in range(2):
        with pytest.raises(ddo.DynamicOffloadSourceChangedError, match="changed while in use") as raised:
            run(loaded.module, inputs)
        assert isinstance(raised.value, ddo.DynamicOffloadCheckpointError)
    with pytest.raises(ddo.DynamicOffloadSourceChangedError, match="changed while in use"):
        loaded.module.get_parameter(ENCODED).detach().clone()
    with pytest.raises(ddo.DynamicOffloadSourceChangedError, match="changed while in use"):
        loaded.module.state_dict()[RAW].clone()


def test_outputs_equal_the_resident_models_over_passes_and_after_unload_and_reload(bf16):
    loaded = bf16.load()
    for _ in range(3):
        assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    setup, _ = assert_streamed_encoded(loaded)
    loaded.offload.unload()
    assert all(p.is_meta for p in loaded.module.parameters())
    loaded.offload.reload()
    assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    # Reloaded, the tensors are encoded again (the counters are the new attach's).
    again, _ = assert_streamed_encoded(loaded)
    assert again["encoded_tensors"] == setup["encoded_tensors"]
    slots, freed = loaded.offload.reclaim()
    assert slots == 2 and freed > 0
    assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    loaded.offload.remove()


@pytest.mark.parametrize(
    "source", [{"vmm_source_cache_gb": 1.0}, {"load_safetensors_backend": "pread"}], ids=["retained", "pread"]
)
def test_other_host_sources_stream_encoded_bit_for_bit(bf16, source):
    """The encoded tensors are left out of retained windows and reads; the rest still come
    from them."""
    loaded = bf16.load(**source)
    for _ in range(2):
        assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    state = loaded.module.state_dict()
    assert [k for k, v in bf16.tensors.items() if not same_bits(state[k].clone(), v)] == []
    assert_streamed_encoded(loaded)
    loaded.offload.remove()


def test_the_link_carries_an_encoded_tensor_once_and_the_profile_says_so(bf16):
    """Every unit resident (one upload each): with encoding on, what crosses besides the
    encodings is the bytes of the tensors served raw, never the encoded tensors' own bytes as
    well (a copy bridging the gap between two raw tensors must not carry them)."""
    uploads = {}
    for mode in ("off", "on"):
        loaded = bf16.load(vmm_weight_encoding=mode, vmm_resident_weight_budget_gb=0.05)
        assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
        setup, runtime = counters(loaded)
        assert (setup["streamed_units"], runtime["uploads"]) == (0, setup["unit_count"])
        uploads[mode] = (setup, runtime, loaded.offload.metrics_snapshot().format_profile())
        loaded.offload.remove()
    (_, off, _), (setup, on, profile) = uploads["off"], uploads["on"]
    raw = setup["total_bytes"] - setup["encoding_source_bytes"]
    assert on["decoded_bytes"] == setup["encoding_source_bytes"] and on["encoded_upload_bytes"] == setup["encoded_bytes"]
    assert on["upload_bytes"] - on["encoded_upload_bytes"] <= off["upload_bytes"] - on["decoded_bytes"] + (16 << 10)
    assert on["upload_bytes"] - on["encoded_upload_bytes"] < 2 * raw, (on, raw)
    # The profile gives the decoding rate of the host backend (well under 1 GB/s on the CPU).
    line = next(x for x in profile.splitlines() if "decodes=" in x)
    rate = float(line.split("decode_gb_per_second=")[1].split()[0])
    assert 0 < rate == pytest.approx(on["decoded_bytes"] / on["decode_seconds"] / 1e9, abs=0.01), line
    assert "encoding=mode=on" in profile


def test_a_budget_too_small_for_the_staging_of_the_encodings_says_what_to_set(bf16):
    """Nothing streams (no block matches vmm_module_pattern): the one resident unit and the
    staging buffers the encodings pass through are the whole need, and the budget the message
    names works."""
    with pytest.raises(ddo.DynamicOffloadCapacityError, match="staging buffers") as raised:
        bf16.load(vmm_module_pattern="^nothing$")
    message = str(raised.value)
    assert "vmm_resident_weight_budget_gb" in message and "GiB or more" not in message, message
    mib = float(message.split("raise the budget to ")[1].split(" MiB")[0])
    assert mib < 64, message
    loaded = bf16.load(vmm_module_pattern="^nothing$", vmm_resident_weight_budget_gb=mib / 1024)
    assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    setup, runtime = counters(loaded)
    assert setup["unit_count"] == 1 and setup["encoded_tensors"] > 0 and runtime["device_decodes"] > 0
    loaded.offload.remove()


def test_a_keyboard_interrupt_inside_a_block_leaves_the_next_forward_correct(bf16):
    loaded = bf16.load()

    def interrupt(_m, _args):
        raise KeyboardInterrupt

    handle = loaded.module.single_transformer_blocks[0].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(loaded.module, bf16.inputs)
    handle.remove()
    got = []
    t = threading.Thread(target=lambda: got.append(same_bits(run(loaded.module, bf16.inputs), bf16.reference)))
    t.start()
    t.join(timeout=60)
    assert got == [True], "another thread runs the module after the interrupt"
    assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
    assert_streamed_encoded(loaded)
    loaded.offload.remove()


@pytest.mark.parametrize("end", ["remove", "remove_dynamic_offload", "unload"])
def test_a_weight_kept_after_the_offload_ends_reads_the_checkpoint_or_says_why_not(bf16, end):
    loaded = bf16.load()
    run(loaded.module, bf16.inputs)
    assert_streamed_encoded(loaded)
    resident = loaded.module.get_parameter("x_embedder.weight")
    streamed = loaded.module.get_parameter(ENCODED)
    # Between passes a streamed (encoded) weight is a placeholder that reads the checkpoint.
    assert isinstance(streamed, ddo.StreamedWeight)
    assert same_bits(streamed.detach().clone(), bf16.tensors[ENCODED])
    if end == "remove":
        loaded.offload.remove()
    elif end == "remove_dynamic_offload":
        ddo.remove_dynamic_offload(loaded.module)
    else:
        with pytest.warns(UserWarning, match="still view its device memory"):
            loaded.offload.unload()
    # A resident weight owns its memory; a placeholder says the offload ended, never reads
    # other bytes.
    assert same_bits(resident, bf16.tensors["x_embedder.weight"])
    with pytest.raises(ddo.DynamicOffloadLifecycleError, match="remove|unloaded"):
        streamed.float().sum()


def test_state_dict_between_passes_is_the_checkpoint(bf16):
    loaded = bf16.load()
    for _ in range(2):
        assert same_bits(run(loaded.module, bf16.inputs), bf16.reference)
        state = loaded.module.state_dict()
        assert state.keys() == bf16.tensors.keys()
        assert [k for k, v in bf16.tensors.items() if not same_bits(state[k].clone(), v)] == []
    assert_streamed_encoded(loaded)
    loaded.offload.remove()


def test_forwards_from_two_threads_are_both_correct(bf16):
    loaded = bf16.load()
    outcomes = []

    def worker():
        for _ in range(2):
            outcomes.append(same_bits(run(loaded.module, bf16.inputs), bf16.reference))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcomes == [True] * 4
    assert_streamed_encoded(loaded)
    loaded.offload.remove()


def rewrite_in_place(path, names, tensors):
    """Overwrites the data of the tensors ``names`` inside the file with their negation: same
    size and inode, a later modification time."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        for n in names:
            start, end = header[n]["data_offsets"]
            f.seek(8 + header_len + start)
            f.write((-tensors[n]).contiguous().view(torch.uint8).numpy().tobytes()[: end - start])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    after = os.stat(path)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert after.st_mtime_ns != before.st_mtime_ns


@pytest.mark.parametrize("names", [[ENCODED, RAW], [ENCODED]], ids=["encoded-and-raw", "encoded-only"])
def test_a_checkpoint_rewritten_underneath_is_an_error_and_reloading_recovers(bf16, tmp_path, names):
    saved = bf16.copy(tmp_path)
    loaded = saved.load()
    assert same_bits(run(loaded.module, saved.inputs), saved.reference)
    assert_streamed_encoded(loaded)
    rewrite_in_place(saved.file, names, saved.tensors)
    # Even when only an encoded tensor's bytes changed (host memory holds its encoding from
    # before), the module refuses rather than serve a mix of old and new weights.
    assert_refused_until_reloaded(loaded, saved.inputs)
    loaded.offload.unload()
    loaded.offload.reload()  # the file as it is now
    want = saved.resident_output()
    assert not same_bits(want, saved.reference)
    assert same_bits(run(loaded.module, saved.inputs), want)
    assert same_bits(loaded.module.get_parameter(ENCODED).detach().clone(), -saved.tensors[ENCODED])
    assert_streamed_encoded(loaded)
    loaded.offload.remove()
    # Loading it again works too.
    again = saved.load()
    assert same_bits(run(again.module, saved.inputs), want)
    again.offload.remove()


def test_a_checkpoint_truncated_underneath_is_an_error_and_restoring_it_recovers(bf16, tmp_path):
    saved = bf16.copy(tmp_path)
    loaded = saved.load()
    assert same_bits(run(loaded.module, saved.inputs), saved.reference)
    data = saved.file.read_bytes()
    os.truncate(saved.file, len(data) // 2)
    # The mapping's pages of the encoded tensors were dropped at load: nothing may read past
    # the new end of the file (which would kill the process), it is refused first.
    assert_refused_until_reloaded(loaded, saved.inputs)
    loaded.offload.unload()
    with pytest.raises(ddo.DynamicOffloadCheckpointError, match="goes beyond the data section"):
        loaded.offload.reload()
    saved.file.write_bytes(data)
    loaded.offload.reload()
    assert same_bits(run(loaded.module, saved.inputs), saved.reference)
    assert_streamed_encoded(loaded)
    loaded.offload.remove()


def test_an_encoded_file_serves_later_loads_and_never_a_changed_checkpoint(bf16, tmp_path):
    """``vmm_encoded_cache_dir``: the first load writes the encodings, the next maps them; a
    damaged file is encoded again, and a checkpoint rewritten with its size and modification
    time kept is never served from the encodings of its old bytes."""
    saved = bf16.copy(tmp_path)
    cache = tmp_path / "cache"

    def load_and_check(want, note):
        loaded = saved.load(vmm_encoded_cache_dir=str(cache))
        assert same_bits(run(loaded.module, saved.inputs), want)
        setup, _ = assert_streamed_encoded(loaded)
        assert note in setup["weight_encoding"], setup["weight_encoding"]
        loaded.offload.remove()
        return setup

    setup = load_and_check(saved.reference, "written")
    # Beside the encoded file: its use mark (and, where auto decided, its decision record).
    (path,) = [p for p in cache.iterdir() if p.suffix == ".ddoenc"]
    assert setup["encoded_file"] == str(path)
    assert load_and_check(saved.reference, f"read from {path}")["encoded_tensors"] == setup["encoded_tensors"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    load_and_check(saved.reference, "re-encoded")
    load_and_check(saved.reference, "read from")
    before = os.stat(saved.file)
    rewrite_in_place(saved.file, [ENCODED], saved.tensors)
    os.utime(saved.file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(saved.file)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    changed = saved.resident_output()
    assert not same_bits(changed, saved.reference)
    load_and_check(changed, "re-encoded")
    # A folder that cannot be written leaves the encodings unsaved, nothing else.
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"")
    loaded = saved.load(vmm_encoded_cache_dir=str(blocked / "cache"))
    assert "could not be written" in counters(loaded)[0]["weight_encoding"]
    assert same_bits(run(loaded.module, saved.inputs), changed)
    loaded.offload.remove()


def capture_streamed_weights(module):
    """Pre-hooks on every block recording its weights as the arena holds them during the pass
    (decoded)."""
    seen = {}

    def grab(prefix):
        def hook(m, _args):
            for n, p in m.named_parameters():
                seen[f"{prefix}.{n}"] = p.detach().clone()

        return hook

    handles = [m.register_forward_pre_hook(grab(p)) for p, m in ddo.find_execution_units(module)]
    return seen, handles


def all_patterns(tensors):
    """Every 16-bit pattern (NaNs of every payload, infinities, subnormals, -0) in the first
    65536 elements of one streamed weight."""
    w = tensors[PATTERNS]
    flat = w.view(torch.int16).reshape(-1).clone()
    flat[: 1 << 16] = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    tensors[PATTERNS] = flat.view(w.dtype).reshape(w.shape)


def specials(tensors):
    """NaN, +-Inf, the largest finite values and -0 in one weight, the rest left as it was."""
    w = tensors[SPECIALS].clone()
    big = torch.finfo(w.dtype).max
    w[0, :6] = torch.tensor([float("nan"), float("inf"), float("-inf"), big, -big, -0.0], dtype=w.dtype)
    w[3, 7] = float("nan")
    tensors[SPECIALS] = w


@pytest.mark.parametrize("edit", [all_patterns, specials], ids=["every-bit-pattern", "nan-inf-huge"])
def test_special_values_in_the_checkpoint_stream_back_bit_for_bit(bf16, tmp_path, edit):
    saved = bf16.copy(tmp_path, edit)
    name = PATTERNS if edit is all_patterns else SPECIALS
    assert not torch.isfinite(saved.tensors[name]).all()
    loaded = saved.load()
    seen, handles = capture_streamed_weights(loaded.module)
    for _ in range(2):
        seen.clear()
        assert same_bits(run(loaded.module, saved.inputs), saved.reference)
        assert name in seen
        assert [n for n, t in seen.items() if not same_bits(t, saved.tensors[n])] == []
    for h in handles:
        h.remove()
    # The edited tensor stayed encoded: as many tensors are held encoded as without the edit.
    setup, _ = assert_streamed_encoded(loaded)
    plain = bf16.load()
    assert setup["encoded_tensors"] == counters(plain)[0]["encoded_tensors"]
    plain.offload.remove()
    assert same_bits(loaded.module.get_parameter(name).detach().clone(), saved.tensors[name])
    loaded.offload.remove()


def test_an_fp16_model_streams_encoded_bit_for_bit(bf16, tmp_path):
    saved = Saved(tmp_path, torch.float16)
    # fp16 encodings shrink less (about 0.85x): the staging buffers they pass through take more
    # of the budget.
    assert saved.budget_gb > bf16.budget_gb
    loaded = saved.load()
    for _ in range(2):
        assert same_bits(run(loaded.module, saved.inputs), saved.reference)
    setup, _ = assert_streamed_encoded(loaded)
    assert setup["encoded_bytes"] > 0.75 * setup["encoding_source_bytes"]
    state = loaded.module.state_dict()
    assert [k for k, v in saved.tensors.items() if not same_bits(state[k].clone(), v)] == []
    loaded.offload.remove()


@pytest.mark.parametrize("value", ["yes", "1", "true", "maybe", ""])
def test_a_bad_value_is_refused_naming_the_setting_and_the_allowed_values(bf16, value):
    message = rf'vmm_weight_encoding = "{value}" \(from config\) is not valid; allowed: one of: off, auto, on'
    with pytest.raises(ddo.DynamicOffloadConfigError, match=message):
        ddo.DynamicOffloadConfig(vmm_weight_encoding=value).to_json()
    with pytest.raises(ddo.DynamicOffloadConfigError, match=message):
        bf16.load(vmm_weight_encoding=value)


def test_bad_values_from_variables_arguments_and_flags_name_the_setting(bf16):
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r'environment variable DDO_VMM_WEIGHT_ENCODING="yes"'):
        ddo.load_dynamic_offload_settings_from_env(
            execution_device="cpu",
            offload_device="cpu",
            target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
            skip_modules_pattern=(),
            environ={"DDO_VMM_WEIGHT_ENCODING": "yes"},
        )
    from diffusers import FluxTransformer2DModel

    module = FluxTransformer2DModel.from_pretrained(bf16.path, torch_dtype=bf16.dtype).eval()
    before = {n: p.data_ptr() for n, p in module.named_parameters()}
    with pytest.raises(ddo.DynamicOffloadConfigError, match=r'vmm_weight_encoding = "yes" \(from argument\)'):
        ddo.enable_offload(module, route="dynamic_offload", use_environment=False, vmm_weight_encoding="yes")
    assert {n: p.data_ptr() for n, p in module.named_parameters()} == before
    parser = ddo.add_dynamic_offload_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--ddo-backend", "vmm", "--ddo-vmm-weight-encoding", "yes"])
    with pytest.raises(
        ddo.DynamicOffloadConfigError,
        match=r'vmm_weight_encoding = "yes" .*allowed: one of: off, auto, on \(set by the flags --ddo-vmm-weight-encoding\)',
    ):
        ddo.build_config_from_args(args)
    # Accepted values, as the variable parses them; the flag left out leaves the variable to decide.
    assert ddo.build_config_from_args(parser.parse_args(["--ddo-vmm-weight-encoding", "on"])).as_dict() == {
        "vmm_weight_encoding": "on"
    }
    assert "vmm_weight_encoding" not in ddo.build_config_from_args(parser.parse_args([])).as_dict()
    args = parser.parse_args(["--ddo-vmm-weight-encoding", "on", "--ddo-vmm-encoded-cache-dir", "/tmp/ddo-encoded"])
    assert ddo.build_config_from_args(args).as_dict() == {
        "vmm_weight_encoding": "on",
        "vmm_encoded_cache_dir": "/tmp/ddo-encoded",
    }
    assert ddo.DynamicOffloadConfig().vmm_weight_encoding is None
    for value, resolved in (("ON", "on"), (" auto ", "auto"), ("off", "off")):
        s = ddo.load_dynamic_offload_settings_from_env(
            execution_device="cpu",
            offload_device="cpu",
            target_module_classes=(torch.nn.Linear, torch.nn.Embedding),
            skip_modules_pattern=(),
            environ={"DDO_VMM_WEIGHT_ENCODING": value},
        )
        assert s.values["vmm_weight_encoding"] == resolved
