"""LoRA adapters served beside their base model: many teams' fine-tunes in one batch (S-LoRA / Punica style).

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`). Each of its target modules
adds `scaling * B @ (A @ x)` to the base linear's output. A step's rows are grouped by adapter (the runner
orders them so each adapter's tokens are contiguous: `segments_of`). The base weights may be packed
int8/int4; the adapter stays float, in the activations' dtype, and the base's rows get no delta at all.

How a step adds the deltas, per fused linear of each layer (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`):
- on the CPU, one native call for every adapter of the step (kernels/lora.py, kernels/csrc/lora_cpu.cpp):
  each segment's shrink (its modules' A stacked: q, k and v share one) and expand. The layout it reads
  (`AdapterTable`) is made once per adapter, at load, over the same tensors. In torch, a segment had cost
  ~11 small matmuls a layer (25-45 us each, mostly thread-pool wake-ups and MKL's small-matrix path): 8 rows
  over 4 adapters doubled a SmolLM2-135M decode step. Natively the deltas cost about what reading the
  adapters' matrices costs (bench/lora_bench.py);
- elsewhere (CUDA, no compiler, native kernels switched off), per segment in torch: a shrink matmul, then an
  expand per module into its columns of the output.

Model side, nothing is restructured: for a step with adapter rows, `lora_step` swaps each layer's fused
linears for wrappers that add the adapters (`LoraLinear`), and puts them back after. A decode step with packed
weights still runs as the fused native decode stack (kernels/decode_stack.py), which calls the native kernel
after each linear itself; steps of the base alone run exactly as before.

`AdapterPool` keeps at most `max_loras` adapters resident, loads one on first use and evicts the least
recently used one that no unfinished request holds.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

import kernels
from kernels import lora as native
from kernels.decode_stack import DecodeStack
from kernels.lora import AdapterTable, LoraStep, Piece

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
# which fused linear of a layer a module's output lands in, and in which output piece
FUSED: dict[str, tuple[str, int]] = {
    "q": ("qkv_proj", 0),
    "k": ("qkv_proj", 1),
    "v": ("qkv_proj", 2),
    "o": ("o_proj", 0),
    "gate": ("gate_up_proj", 0),
    "up": ("gate_up_proj", 1),
    "down": ("down_proj", 0),
}
LINEAR_ATTRIBUTES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
    r"\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot run on this base model; the message names the mismatch."""


class BaseLinear(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


# ---- what a base model offers adapters ----------------------------------------------------------------
@dataclass(frozen=True)
class LoraDims:
    """Per module, (in_features, out_features) of the base model's layers, and how many layers there are."""

    num_layers: int
    modules: dict[str, tuple[int, int]]

    @classmethod
    def of_model(cls, model: Any) -> LoraDims:
        """Read off the built model's layers: family-independent, as long as a layer keeps its fused linears
        as the attributes in LINEAR_ATTRIBUTES (a mixture-of-experts layer has no `gate_up_proj`: no mlp
        targets then)."""
        layers = list(model.layers)
        layer = layers[0]
        modules: dict[str, tuple[int, int]] = {}
        qkv = getattr(layer, "qkv_proj", None)
        if qkv is not None and hasattr(layer, "q_size") and hasattr(layer, "kv_size"):
            for name, out in (("q", layer.q_size), ("k", layer.kv_size), ("v", layer.kv_size)):
                modules[name] = (qkv.in_features, out)
        for name, attribute in (("o", "o_proj"), ("down", "down_proj")):
            linear = getattr(layer, attribute, None)
            if linear is not None:
                modules[name] = (linear.in_features, linear.out_features)
        gate_up = getattr(layer, "gate_up_proj", None)
        if gate_up is not None:
            modules["gate"] = modules["up"] = (gate_up.in_features, gate_up.out_features // 2)
        return cls(len(layers), modules)


# ---- an adapter on disk -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterManifest:
    """What registration reads from a PEFT folder, without loading its weights."""

    path: str
    rank: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    base_model_name: str | None
    fingerprint: str  # of the weights file: KV computed under other weights is never reused
    tensor_shapes: dict[str, tuple[int, ...]] = field(repr=False)
    nbytes: int = 0  # of the weights as loaded (float32)


def read_manifest(path: str | Path) -> AdapterManifest:
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter path {str(folder)!r} is not a folder")
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise AdapterError(f"adapter folder {str(folder)!r} has no {needed.name}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{flag} adapters are not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise AdapterError(f"{pattern} (per-module ranks) is not supported")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save (fully trained extra modules) is not supported, only LoRA matrices")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config.get('bias')!r} is not supported (only 'none')")
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = float(alpha) / (rank**0.5 if config.get("use_rslora") else rank)
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"{WEIGHTS_FILE} could not be read: {error}") from None
    targets: set[str] = set()
    for key in shapes:
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"tensor {key!r} is not a LoRA matrix of a decoder layer's q/k/v/o/gate/up/down projection"
            )
        targets.add(match.group(2))
    if not targets:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    digest = hashlib.blake2b(weights_path.read_bytes(), digest_size=16).hexdigest()
    nbytes = sum(4 * _numel(shape) for shape in shapes.values())
    return AdapterManifest(
        path=str(folder),
        rank=rank,
        lora_alpha=float(alpha),
        scaling=scaling,
        target_modules=tuple(m for m in MODULES if m in targets),
        base_model_name=config.get("base_model_name_or_path"),
        fingerprint=digest,
        tensor_shapes=shapes,
        nbytes=nbytes,
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_against(manifest: AdapterManifest, dims: LoraDims, max_rank: int) -> None:
    """Raises AdapterError naming the first mismatch between the adapter and the base model."""
    if manifest.rank > max_rank:
        raise AdapterError(f"rank {manifest.rank} is above the largest served rank, {max_rank}")
    missing = [m for m in manifest.target_modules if m not in dims.modules]
    if missing:
        raise AdapterError(f"target modules {missing} do not exist in the base model (it has {list(dims.modules)})")
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in manifest.tensor_shapes.items():
        match = _KEY.match(key)
        assert match is not None  # read_manifest checked every key
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= dims.num_layers:
            raise AdapterError(f"tensor {key!r} is for layer {layer}, but the base model has {dims.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = shape
    for (layer, module), found in sorted(pairs.items()):
        if set(found) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}_proj has lora_{next(iter(found))} but not its pair")
        in_features, out_features = dims.modules[module]
        rank = found["A"][0] if len(found["A"]) == 2 else -1
        if found["A"] != (rank, in_features) or found["B"] != (out_features, rank) or rank > max_rank:
            raise AdapterError(
                f"layer {layer} {module}_proj: lora_A {list(found['A'])} and lora_B {list(found['B'])} do not fit "
                f"the base model's {module}_proj ({in_features} in, {out_features} out, rank <= {max_rank})"
            )


# ---- an adapter in memory -----------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedLora:
    """One adapter's matrices for one fused linear: the modules' A stacked (one shrink), then per module its B
    (scaled, transposed) and where its rows of the shrunk activations and columns of the output lie."""

    a: torch.Tensor  # [sum of ranks, in_features]: lora_A's rows, module after module
    pieces: tuple[Piece, ...]  # (rank start, rank end, col start, col end, B.T)


@dataclass(frozen=True)
class LoraWeights:
    name: str
    layers: tuple[dict[str, FusedLora], ...]  # per layer: fused linear attribute -> its matrices
    nbytes: int
    table: AdapterTable | None = field(default=None, repr=False)  # the same matrices for the native kernel


def load_weights(
    name: str,
    manifest: AdapterManifest,
    dims: LoraDims,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> LoraWeights:
    """The adapter's matrices, laid out for LoraLinear, in the activations' dtype on the model's device (and,
    where the native kernel is built for the CPU and that dtype, as its table too: the same tensors)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(manifest.path) / WEIGHTS_FILE))
    return weights_from_tensors(name, tensors, manifest.scaling, dims, dtype, device)


def weights_from_tensors(
    name: str,
    tensors: dict[str, torch.Tensor],
    scaling: float,
    dims: LoraDims,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> LoraWeights:
    """`load_weights` from the tensors of a PEFT weights file (checked: `check_against`)."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        assert match is not None
        found.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    layers: list[dict[str, FusedLora]] = []
    nbytes = 0
    for layer in range(dims.num_layers):
        fused: dict[str, FusedLora] = {}
        for attribute in LINEAR_ATTRIBUTES:
            members = [m for m, (attr, _) in sorted(FUSED.items(), key=lambda i: i[1][1]) if attr == attribute]
            a_parts: list[torch.Tensor] = []
            pieces: list[Piece] = []
            rank_start = col_start = 0
            for module in members:
                if module not in dims.modules:
                    continue
                out = dims.modules[module][1]
                pair = found.get((layer, module))
                if pair is not None:
                    a, b = pair["A"].float(), pair["B"].float()
                    rank = a.shape[0]
                    a_parts.append(a)
                    b_t = (b * scaling).t().contiguous().to(device=device, dtype=dtype)
                    pieces.append((rank_start, rank_start + rank, col_start, col_start + out, b_t))
                    rank_start += rank
                col_start += out
            if a_parts:
                a = torch.cat(a_parts).contiguous().to(device=device, dtype=dtype)
                fused[attribute] = FusedLora(a, tuple(pieces))
                nbytes += a.nbytes + sum(piece[4].nbytes for piece in pieces)
        layers.append(fused)
    table = None
    if (device is None or device.type == "cpu") and native.available(dtype):
        table = AdapterTable(
            [
                None if (f := layer.get(attribute)) is None else (f.a, f.pieces)
                for layer in layers
                for attribute in LINEAR_ATTRIBUTES
            ],
            dtype,
        )
    return LoraWeights(name, tuple(layers), nbytes, table)


# ---- one step: which token rows run which adapter ------------------------------------------------------
@dataclass(frozen=True)
class LoraSegment:
    start: int  # token rows [start, end) of the step's flattened batch
    end: int
    weights: LoraWeights


class LoraLinear:
    """The base linear plus each segment's adapter: shrink, then expand into the module's output columns; in one
    native call for all segments (`native`, kernels/lora.py) where the step has one, else per segment in torch."""

    def __init__(
        self,
        base: BaseLinear,
        layer: int,
        attribute: str,
        segments: list[LoraSegment],
        native: LoraStep | None = None,
    ) -> None:
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.layer = layer
        self.attribute = attribute
        self.segments = segments
        self.native = native
        self.linear_index = layer * len(LINEAR_ATTRIBUTES) + LINEAR_ATTRIBUTES.index(attribute)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.native is not None and x.dim() == 2:
            return self.native.add(self.linear_index, x, out)
        rows = x.reshape(-1, self.in_features)
        flat = out.view(-1, self.out_features)
        if self.native is not None:
            return self.native.add(self.linear_index, rows, flat).view(out.shape)
        for segment in self.segments:
            fused = segment.weights.layers[self.layer].get(self.attribute)
            if fused is None:
                continue
            shrunk = rows[segment.start : segment.end] @ fused.a.t()
            target = flat[segment.start : segment.end]
            for rank_start, rank_end, col_start, col_end, b_t in fused.pieces:
                target[:, col_start:col_end].addmm_(shrunk[:, rank_start:rank_end], b_t)
        return out


def native_step(model: Any, segments: list[LoraSegment]) -> LoraStep | None:
    """The step's segments for the native kernel, where it runs them all: CPU activations, native kernels on,
    and every segment's adapter laid out for it."""
    dtype = getattr(model, "dtype", None)
    tables = [segment.weights.table for segment in segments]
    if not segments or not kernels.native_cpu_enabled() or not isinstance(dtype, torch.dtype):
        return None
    if any(table is None or table.dtype != dtype for table in tables) or not native.available(dtype):
        return None
    return LoraStep([(s.start, s.end, t) for s, t in zip(segments, tables, strict=True) if t is not None])


class _StackWithLora:
    """The model's fused native decode stack, handed the step's adapters: it adds their deltas itself."""

    def __init__(self, stack: DecodeStack, step: LoraStep) -> None:
        self.stack = stack
        self.step = step

    def __call__(
        self,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        return self.stack(embedded, positions, slot_mapping, block_tables, context_lens, lora=self.step)


@contextmanager
def lora_step(model: Any, segments: list[LoraSegment]) -> Iterator[None]:
    """Runs the block with the model's layer linears adding `segments`' adapters. The fused native decode stack
    (which reads the packed weights itself) adds them too where the native kernel runs them (`native_step`),
    else it is turned off for the block. Restores both after."""
    if not segments:
        yield
        return
    step = native_step(model, segments)
    swapped: list[tuple[Any, str, Any, LoraLinear]] = []  # (layer, attribute, base linear, its wrapper)
    for index, layer in enumerate(model.layers):
        for attribute in LINEAR_ATTRIBUTES:
            base = getattr(layer, attribute, None)
            if base is not None:
                swapped.append((layer, attribute, base, LoraLinear(base, index, attribute, segments, step)))

    def install(wrapped: bool) -> None:
        for layer, attribute, base, wrapper in swapped:
            setattr(layer, attribute, wrapper if wrapped else base)

    had_stack = "decode_stack" in vars(model)
    stack_of: Callable[..., DecodeStack | None] | None = getattr(model, "decode_stack", None)
    if step is not None and stack_of is not None:

        def stack_with_lora(*args: Any) -> _StackWithLora | None:
            assert stack_of is not None and step is not None
            install(False)  # the stack is built (once) from the base linears' packed weights
            try:
                stack = stack_of(*args)
            finally:
                install(True)
            return None if stack is None else _StackWithLora(stack, step)

        model.decode_stack = stack_with_lora
    else:
        model.decode_stack = lambda *args, **kwargs: None
    install(True)
    try:
        yield
    finally:
        install(False)
        if not had_stack:
            del model.decode_stack


def segments_of(row_adapters: list[LoraWeights | None]) -> list[LoraSegment]:
    """Maximal runs of token rows under one adapter (base rows make none)."""
    segments: list[LoraSegment] = []
    start = 0
    for index in range(1, len(row_adapters) + 1):
        if index == len(row_adapters) or row_adapters[index] is not row_adapters[start]:
            weights = row_adapters[start]
            if weights is not None:
                segments.append(LoraSegment(start, index, weights))
            start = index
    return segments


# ---- the resident pool --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterRef:
    """The adapter a request runs under: its name, and the fingerprint of its weights (salts the prefix cache)."""

    name: str
    fingerprint: str


@dataclass
class PoolStats:
    loads: int = 0
    evictions: int = 0
    load_seconds_total: float = 0.0


class AdapterPool:
    """Registered adapters (manifests only) and at most `max_resident` of them loaded, in LRU order."""

    def __init__(
        self,
        dims: LoraDims,
        dtype: torch.dtype,
        max_resident: int,
        max_rank: int,
        device: torch.device | None = None,
    ) -> None:
        if max_resident < 1:
            raise ValueError("max_loras must be at least 1")
        self.dims = dims
        self.dtype = dtype
        self.device = device
        self.max_resident = max_resident
        self.max_rank = max_rank
        self.registered: dict[str, AdapterManifest] = {}
        self.resident: OrderedDict[str, LoraWeights] = OrderedDict()
        self.users: dict[str, int] = {}
        self.stats = PoolStats()
        # registration comes from the app's threads while the engine thread acquires and releases
        self._lock = threading.Lock()

    def check(self, path: str | Path) -> AdapterManifest:
        """The folder's manifest, checked against the base model (AdapterError naming the mismatch)."""
        manifest = read_manifest(path)
        check_against(manifest, self.dims, self.max_rank)
        return manifest

    def register(self, name: str, manifest: AdapterManifest) -> None:
        with self._lock:
            old = self.registered.get(name)
            if old is not None and old.fingerprint != manifest.fingerprint and self.users.get(name):
                raise AdapterError(f"adapter {name!r} is in use; its weights cannot change now")
            if old is not None and old.fingerprint != manifest.fingerprint:
                self.resident.pop(name, None)
            self.registered[name] = manifest

    def unregister(self, name: str) -> None:
        with self._lock:
            if self.users.get(name):
                raise AdapterError(f"adapter {name!r} is in use by running requests")
            self.registered.pop(name, None)
            self.resident.pop(name, None)

    def ref(self, name: str) -> AdapterRef:
        manifest = self.registered.get(name)
        if manifest is None:
            raise KeyError(name)
        return AdapterRef(name, manifest.fingerprint)

    def try_acquire(self, name: str) -> bool:
        """Holds `name` resident for a request (loading it, evicting the least recently used idle one if the
        pool is full); False when every resident adapter is held by running requests."""
        with self._lock:
            if name not in self.resident:
                if len(self.resident) >= self.max_resident:
                    idle = next((n for n in self.resident if not self.users.get(n)), None)
                    if idle is None:
                        return False
                    del self.resident[idle]
                    self.stats.evictions += 1
                started = time.perf_counter()
                self.resident[name] = load_weights(name, self.registered[name], self.dims, self.dtype, self.device)
                self.stats.loads += 1
                self.stats.load_seconds_total += time.perf_counter() - started
            self.resident.move_to_end(name)
            self.users[name] = self.users.get(name, 0) + 1
            return True

    def release(self, name: str) -> None:
        with self._lock:
            count = self.users.get(name, 0) - 1
            if count > 0:
                self.users[name] = count
            else:
                self.users.pop(name, None)

    def weights(self, name: str) -> LoraWeights:
        return self.resident[name]

    @property
    def resident_nbytes(self) -> int:
        return sum(weights.nbytes for weights in self.resident.values())
