"""Hooks and the lease ledger: a module's forward (and a VAE's ``encode``/``decode``) runs as one
pass of the session; each hooked block's pre-hook leases its unit and swaps its views in, its
post-hook gives the lease back on PyTorch's current stream and puts the placeholders back."""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import _native
from ..errors import DynamicOffloadUnsupportedError
from .guards import refuse_traced
from .publishing import SwapUpdates
from .torch_internals import plain_tensor_methods, raw_stream_reader
from .values import move_inputs, tensors_in

__all__ = ["Hooks", "Lease", "current_stream", "eager", "stream_reader"]

# Methods of a module that run a pass of their own on every arena route (a VAE's entry points).
_VAE_ENTRIES = ("encode", "decode")
_NO_SWAPS = SwapUpdates([], [])


class Lease(NamedTuple):
    """A unit's lease a hook took, and the stream it was taken on (it is given back there)."""

    lease: int
    stream: int


def current_stream(device: torch.device) -> int:
    """PyTorch's current stream on ``device`` as a handle (0 on the host)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def stream_reader(device: torch.device) -> Callable[[], int]:
    """A function giving PyTorch's current stream on ``device`` as a handle: the hooks ask for it
    twice per block, so it skips building a ``torch.cuda.Stream`` where PyTorch offers the raw
    handle."""
    if device.type != "cuda":
        return lambda: 0
    raw = raw_stream_reader(device.index if device.index is not None else torch.cuda.current_device())
    if raw is None:
        return lambda: current_stream(device)
    return raw


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly by Dynamo, never traced, wherever a compiled region calls it (a block
    compiled on its own, ``block.compile()`` or Diffusers' ``compile_repeated_blocks``, calls
    its hooks inside the region): the compiled graph is the block's own computation, and the
    hook leases the unit and swaps its views in around it. A disabled function is no graph break
    Dynamo counts in a block's region (``fullgraph=True`` compiles), and the hook's own state
    (streams, threads, leases) is nothing Dynamo guards on, so weights streaming into other
    slots each pass cause no recompilation."""
    return torch.compiler.disable(hook, reason="ddo's offload hooks swap weights in and out; they run eagerly")


def _dynamo_failure(error: BaseException) -> bool:
    exc = sys.modules.get("torch._dynamo.exc")
    base = getattr(exc, "TorchDynamoException", None) if exc is not None else None
    return base is not None and isinstance(error, base)


class Hooks:
    """The passes and the blocks' hooks (part of :class:`SessionRuntime`), and the ledger of the
    leases they hold."""

    module: torch.nn.Module
    device: torch.device
    session: Any
    auto_budget: Any
    swaps: dict
    swap_in: Dict[int, SwapUpdates]
    swap_out: Dict[int, SwapUpdates]
    bounds: Dict[int, Tuple[int, int]]
    ranges: dict
    views_whole: bool
    watched: list
    checked: dict
    pass_unchecked: set

    if TYPE_CHECKING:

        def _republish(self) -> None: ...

        def _check_module(self, args: tuple, kwargs: dict) -> None: ...

        def _check_unit(self, unit: int) -> None: ...

        def _check_unreached_units(self) -> None: ...

        def switch_encoding(self) -> bool: ...

    def _init_hooks(self) -> None:
        self.stream: Callable[[], int] = stream_reader(torch.device("cpu"))
        self.handles: List[Any] = []
        # Leases the hooks took, by (thread, unit): a block's post-hook gives back its own
        # thread's; a pass ends only its own thread's.
        self.leases: Dict[Tuple[int, int], List[Lease]] = {}
        # Forwards of one module run one at a time: a pass owns the module's leases.
        self.forward_lock = threading.Lock()
        self.in_forward: Dict[int, bool] = {}
        # The plan's resident units leased for the running pass, its stream and thread: their
        # blocks on that stream in that thread take no lease of their own.
        self.pass_units: frozenset = frozenset()
        self.pass_stream: Optional[int] = None
        self.pass_thread: Optional[int] = None
        # Passes entered (counted eagerly, never by a trace Dynamo abandoned).
        self.passes_entered = 0
        # Methods wrapped in a pass (``forward``; a VAE's ``encode``/``decode`` on the layer route).
        self.entries: List[str] = []

    def _wrap_forward(self) -> None:
        """Wraps the module's forward in one pass: forwards of the module run one at a time
        (other threads wait), inputs move to the device, and the pass ends however the forward
        ends (an exception, ``KeyboardInterrupt`` included, aborts it: leases are given back and
        the order seen is not learned). A VAE's ``encode`` and ``decode`` (what pipelines call)
        are passes too; called from inside a pass (``forward`` calling ``encode``) they belong to
        it."""
        names = ["forward"] + [n for n in _VAE_ENTRIES if callable(getattr(type(self.module), n, None))]
        for name in names:
            setattr(self.module, name, self._entry(name, getattr(self.module, name)))
        self.entries = names

    def _entry(self, name: str, original: Any) -> Any:
        runtime = self

        def entry(*args: Any, **kwargs: Any) -> Any:
            if runtime.in_forward.get(threading.get_ident()):
                if name != "forward":
                    return original(*args, **kwargs)
                raise _native.DynamicOffloadLifecycleError(
                    f"{type(runtime.module).__name__}.forward was called inside its own forward; ddo runs one pass at a time"
                )
            with runtime.forward_lock:
                runtime.in_forward[threading.get_ident()] = True
                runtime.passes_entered += 1
                try:
                    return runtime._pass(original, args, kwargs)
                finally:
                    runtime.in_forward.pop(threading.get_ident(), None)

        @functools.wraps(original)
        def compile_guard(*args: Any, **kwargs: Any) -> Any:
            # Dynamo runs this frame eagerly (compiles what it calls): a whole-module
            # torch.compile(fullgraph=True) fails tracing the entry before the pass begins, and is
            # refused here with what to do instead; the module is untouched and serves on.
            entered = runtime.passes_entered
            try:
                return entry(*args, **kwargs)
            except Exception as error:
                if runtime.passes_entered != entered or not _dynamo_failure(error):
                    raise
                raise DynamicOffloadUnsupportedError(
                    f"torch.compile(fullgraph=True) of the whole {type(runtime.module).__name__} offloaded by ddo: "
                    "one graph cannot hold ddo's pass, which leases each block and swaps its streamed weights in and "
                    "out around it. Compile the repeated blocks instead (regional compilation): "
                    "module.compile_repeated_blocks(fullgraph=True) on a Diffusers model, or block.compile() on each "
                    "repeated block; ddo's hooks run eagerly around each compiled block, and the module serves as it "
                    f"did ({type(error).__name__} from Dynamo: {str(error).splitlines()[0] if str(error) else ''})"
                ) from None

        return torch.compiler.disable(compile_guard, recursive=False)

    def _pass(self, original: Any, args: tuple, kwargs: dict) -> Any:
        if self.session.is_unloaded():
            raise _native.DynamicOffloadLifecycleError(
                f"{type(self.module).__name__} is unloaded (its weights are placeholders): call reload() on its "
                "offload result before the next forward"
            )
        if not self.views_whole:
            # A publish was interrupted: the views still in place must not have been written.
            for owner, attr, p, _address_was, version in self.watched:
                if owner._parameters.get(attr) is p and p._version != version:
                    raise _native.DynamicOffloadLifecycleError(
                        f"parameter {attr} of {type(owner).__name__} was written in place since ddo attached: its "
                        "values come from the checkpoint; call remove_dynamic_offload(module) first, change the module, "
                        "then offload it again"
                    )
            self._republish()
        # Blocks this thread (or a thread that ended) entered directly and never left: their
        # leases back, their weights on placeholders again; a streamed block another thread
        # runs now is waited for by no one, so the forward says so.
        self._settle_leases(f"{type(self.module).__name__}.forward", streamed_only=True)
        self._check_module(args, kwargs)
        stream = self.stream()
        self.pass_units = frozenset(self.session.begin_pass(stream))
        self.pass_unchecked = set(self.checked)
        self.pass_unchecked.discard(None)
        self.pass_stream, self.pass_thread = stream, threading.get_ident()
        try:
            out = original(*move_inputs(args, self.device), **move_inputs(kwargs, self.device))
            with plain_tensor_methods():
                self._check_unreached_units()
        except BaseException as error:
            self.pass_units = frozenset()
            self.pass_unchecked = set()
            try:
                # The blocks this thread entered and never left, each on the stream it took its
                # lease on; then the pass's own leases, on the pass's stream.
                try:
                    self._release_thread_leases()
                finally:
                    self.session.abort_pass(stream)
            except BaseException as cleanup:  # noqa: BLE001 - attached to the original error
                error.ddo_cleanup_error = cleanup  # type: ignore[attr-defined]
                if hasattr(error, "add_note"):
                    error.add_note(f"ddo could not end the interrupted pass: {cleanup!r}")
            finally:
                self._rest_all()
            raise
        self.pass_units = frozenset()
        self._release_thread_leases()
        self.session.end_pass(stream)
        if self.auto_budget is not None:
            self.auto_budget.after_pass()
        if self.session.encoding_switch_due() and not self.leases:
            try:
                self.switch_encoding()
            except _native.DynamicOffloadError as e:
                # This pass's output stands; the session attached raw again, or is unloaded.
                then = (
                    "it is unloaded: call reload() on its offload result before the next forward"
                    if self.session.is_unloaded()
                    else "it streams raw"
                )
                warnings.warn(
                    f"ddo: {type(self.module).__name__} could not switch to encoded streaming ({e}); {then}",
                    stacklevel=3,
                )
        return out

    def _pre(self, unit: int) -> Callable[[torch.nn.Module, tuple], None]:
        @eager
        def hook(m: torch.nn.Module, _args: tuple) -> None:
            if m.training:
                raise _native.DynamicOffloadLifecycleError(
                    f"block {type(m).__name__} of {type(self.module).__name__} is in training mode; ddo offloads "
                    "inference only: call module.eval()"
                )
            # Dynamo runs this hook eagerly (it is disabled for it); another tracer (torch.export,
            # torch.jit.trace) records it, and a capture may also begin inside the forward.
            refuse_traced(lambda: f"block {type(m).__name__} of {type(self.module).__name__}")
            if unit in self.pass_unchecked:
                with plain_tensor_methods():
                    self._check_unit(unit)
            stream = self.stream()
            if (
                unit in self.pass_units
                and stream == self.pass_stream
                and self.pass_thread == threading.get_ident()
                and self.in_forward.get(self.pass_thread)
            ):
                # Leased for the whole pass on this stream: no lease, no fence per block.
                self.session.reached(unit)
                return
            self.leases.setdefault((threading.get_ident(), unit), []).append(Lease(self.session.acquire(unit, stream), stream))
            swap = self.swap_in.get(unit, _NO_SWAPS)
            any(map(dict.update, swap.dicts, swap.updates))  # each owner's views in place (C-level loop)

        return hook

    def _post(self, unit: int) -> Callable[[torch.nn.Module, tuple, Any], None]:
        @eager
        def hook(m: torch.nn.Module, _args: tuple, out: Any) -> None:
            key = (threading.get_ident(), unit)
            held = self.leases.get(key)
            released = bool(held)
            if held:
                self.session.release(held.pop().lease, self.stream())
            if not held:
                self.leases.pop(key, None)
                # Placeholders back once no thread runs the block (another may still read its
                # views). Without a lease released here (leased for the pass, or its pre-hook
                # refused the block before taking one) this thread put no view in place.
                if released and (not self.leases or not any(u == unit for _, u in tuple(self.leases))):
                    self._rest(unit)
            self._refuse_streamed_output(unit, m, out)
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors_in(out)):
                # Grad enabled inside the forward (a hook, a block's own code) after the entry
                # let it in: backward would read memory that later blocks reuse.
                raise _native.DynamicOffloadLifecycleError(
                    f"autograd recorded {type(m).__name__} ({self._unit_path(unit)}) of {type(self.module).__name__}: "
                    "ddo offloads inference only (backward would read block memory that later blocks reuse); keep "
                    "gradients off inside the forward (torch.no_grad() or torch.inference_mode())"
                )

        return hook

    def _refuse_streamed_output(self, unit: int, m: torch.nn.Module, out: Any) -> None:
        """A block's output may not view its streamed weights: their memory holds other blocks'
        weights once the block ends."""
        bounds = self.bounds.get(unit)
        if bounds is None:
            return
        low_unit, high_unit = bounds
        for t in tensors_in(out):
            # A view of a weight starts inside that weight's memory, so inside the unit's span.
            try:
                at = t.data_ptr()
            except RuntimeError:  # no storage
                continue
            if not low_unit <= at <= high_unit:
                continue
            storage = t.untyped_storage()
            low = storage.data_ptr()
            high = low + storage.nbytes()
            for start, end, name in self.ranges[unit]:
                if low < end and start < high:
                    raise _native.DynamicOffloadLifecycleError(
                        f"the output of {type(m).__name__} ({self._unit_path(unit)}) views its streamed weight "
                        f"{name}, whose memory holds other blocks' weights once the block ends: return a copy "
                        "(.clone()) from that block, or keep the module resident (route none)"
                    )

    def _unit_path(self, unit: int) -> str:
        """The module path of a streamed unit."""
        return next((name for u, name, _ in self.session.units() if u == unit), str(unit))

    def _settle_leases(self, what: str, streamed_only: bool) -> None:
        """Gives back the leases of this thread's blocks and of threads that ended (a block
        interrupted by a ``BaseException`` skips its post-hook), then refuses ``what`` while
        another thread runs a block (a streamed one only, with ``streamed_only``)."""
        if not self.leases:
            return
        alive = {t.ident for t in threading.enumerate()}
        me = threading.get_ident()
        self._release_leases_of(lambda thread: thread == me or thread not in alive)
        running = sorted({u for _, u in tuple(self.leases) if not streamed_only or u in self.swaps})
        if running:
            raise _native.DynamicOffloadLifecycleError(
                f"{what} needs every block of {type(self.module).__name__} at rest, but "
                f"{', '.join(self._unit_path(u) for u in running[:3])} runs in another thread now; call it again "
                "once that block returns"
            )

    def _release_thread_leases(self) -> None:
        """Gives back the leases this thread's blocks took and did not give back (a block
        interrupted, or an exception a forward caught), each on the stream it was taken on;
        other threads' leases stay with them."""
        me = threading.get_ident()
        self._release_leases_of(lambda thread: thread == me)

    def _release_leases_of(self, whose: Callable[[int], bool]) -> None:
        """Gives back the leases of the threads ``whose`` picks, each on the stream it was taken
        on; their blocks go back on placeholders unless another thread still runs them."""
        if not self.leases:
            return
        ended = [key for key in tuple(self.leases) if whose(key[0])]
        for key in ended:
            for lease, stream in self.leases.pop(key, ()):
                self.session.release(lease, stream)
        held = {u for _, u in tuple(self.leases)}
        for _, unit in ended:
            if unit not in held:
                self._rest(unit)

    def _rest(self, unit: int) -> None:
        swap = self.swap_out.get(unit, _NO_SWAPS)
        any(map(dict.update, swap.dicts, swap.updates))

    def _rest_all(self) -> None:
        """Every streamed unit no thread runs back on its placeholders (a pass ended, however
        it ended): each place that holds the unit's view. A place holding anything else keeps
        it (a parameter the host replaced, which the next check refuses, is not undone)."""
        held = {u for _, u in tuple(self.leases)}
        for unit, places in self.swaps.items():
            if unit not in held:
                for owner, attr, view, placeholder in places:
                    if owner._parameters.get(attr) is view:
                        owner._parameters[attr] = placeholder

    def _not_inside_forward(self, what: str) -> None:
        if self.in_forward.get(threading.get_ident()):
            raise _native.DynamicOffloadLifecycleError(f"{what} was called inside the module's forward; call it between passes")
