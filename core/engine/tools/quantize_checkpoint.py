"""``engine quantize``: a prequantized copy of a checkpoint, written with a quantization
method's own export (:meth:`Quantizer.export_weight`).

Which linear modules are quantized is the quantizer's choice on the engine's own model of
the checkpoint (``get_linear_method`` on its layer paths, as when quantizing while loading),
and which checkpoint tensor feeds which layer is the model's own loader's: the checkpoint
streams through ``Model.load_weights`` with each quantized layer's method replaced by one
that hands its tensors over. So any model family works unchanged, and the copy holds the
very tensors the engine would compute while loading the original with ``--quantization``:
the weight rounded to the compute dtype, then exported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.engine.setup import resolve_setup
from engine.interfaces.quantizer import LinearMethod, Quantizer
from engine.layers.linear import MergedLinear, linear_layers, quantize_model
from engine.layers.moe import EXPERT_TENSOR, FUSED_EXPERT_TENSOR, Experts
from engine.model_loader.checkpoint import resolve_model_path, safetensors_files
from engine.model_loader.weights import iterate_weights
from engine.plugins.manager import get_plugin_manager
from engine.runtime.model_builder import construct_model

logger = logging.getLogger("engine")

SAFETENSORS_INDEX = "model.safetensors.index.json"
# files of the source that are weights in another form, never copied
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


@dataclass
class QuantizedCheckpoint:
    """What :func:`quantize_checkpoint` wrote."""

    path: Path
    quantization_config: dict[str, Any]
    dtype: str  # the dtype the weights were rounded to before quantizing
    num_modules: int  # checkpoint linear modules written quantized (routed experts' projections included)
    num_kept: int  # checkpoint tensors written as they were
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    source_bytes: int = 0

    def describe(self) -> str:
        return (
            f"wrote {self.path}: {self.num_modules} linear modules quantized with "
            f"{json.dumps(self.quantization_config)} from their {self.dtype} weights, {self.num_kept} other "
            f"tensors as they were; {self.bytes_written / 2**20:.1f} MiB of safetensors in {len(self.files)} "
            f"file(s) (the source: {self.source_bytes / 2**20:.1f} MiB)"
        )


class _HandOver(LinearMethod):
    """Stands in for a quantized layer's method while the checkpoint streams through the
    model's loader: holds nothing and passes each tensor it is given to ``receive``."""

    def __init__(self, receive: Callable[[MergedLinear, str, int, torch.Tensor], None]) -> None:
        self.receive = receive

    def create_weights(self, layer, input_size, output_sizes, bias, dtype) -> None:
        pass

    def load_weight(self, layer, name, shard, tensor) -> None:
        if name not in self.checkpoint_tensors(layer):
            raise KeyError(
                f"A linear layer quantized by engine quantize takes {', '.join(self.checkpoint_tensors(layer))} "
                f"from the checkpoint, not {name!r}."
            )
        self.receive(layer, name, shard, tensor)

    def apply(self, layer, x):
        raise RuntimeError("engine quantize loads this layer's tensors to export them; it does not compute.")


class _ShardWriter:
    """Safetensors files of at most ``max_bytes`` each (a tensor larger than that gets a file
    of its own), then named as transformers names them, with an index when there are several."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file name, its tensors)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        name = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.written.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, (temporary, tensors) in enumerate(self.written, 1):
            final = f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(self.folder / temporary, self.folder / final)
            names.append(final)
            weight_map.update(dict.fromkeys(tensors, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
        return [*names, SAFETENSORS_INDEX]


def _expert_modules(
    model: torch.nn.Module, quantizer: Quantizer, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]] | None:
    """A routed expert's dense weight (``mlp.experts.<e>.<proj>.weight``) or transformers'
    stacked ones (``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``down_proj`` [E, hidden, I]) as
    ``(checkpoint module, weight)`` per expert projection, where the quantizer quantizes that
    layer's experts (``get_experts_method``); None for any other tensor."""
    match = EXPERT_TENSOR.match(name) or FUSED_EXPERT_TENSOR.match(name)
    if match is None or (EXPERT_TENSOR.match(name) and match.group("suffix") != "weight"):
        return None
    moe = match.group("moe")
    try:
        module = model.get_submodule(moe)
    except AttributeError:
        return None
    if not isinstance(module, Experts) or quantizer.get_experts_method(moe) is None:
        return None
    if EXPERT_TENSOR.match(name):
        return [(name.removesuffix(".weight"), tensor)]
    if match.group("proj") == "down_proj":
        return [(f"{moe}.{e}.down_proj", tensor[e]) for e in range(tensor.shape[0])]
    gate, up = tensor.chunk(2, dim=1)
    return [
        (f"{moe}.{e}.{proj}", part[e])
        for e in range(tensor.shape[0])
        for proj, part in (("gate_proj", gate), ("up_proj", up))
    ]


def _has_export(quantizer: Quantizer) -> bool:
    return type(quantizer).export_weight is not Quantizer.export_weight


def quantize_checkpoint(
    config: EngineConfig, dst: str | Path, *, max_shard_bytes: int = 5 * 10**9, progress: bool = True
) -> QuantizedCheckpoint:
    """Write ``config.model`` (unquantized) quantized by ``config.quantization`` with
    ``config.quantization_config`` to ``dst``, which must not exist: config.json with the
    quantization_config, the quantized linear modules as ``export_weight`` gives them, every
    other tensor as stored, and the source's other files (tokenizer, generation config, chat
    template). The weights are rounded to the compute dtype ``config.dtype`` resolves to first,
    as loading with ``--quantization`` does."""
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; engine quantize writes a new directory: give another DST.")
    if config.quantization is None:
        raise ValueError("engine quantize needs --quantization NAME: the method to quantize with.")
    src = resolve_model_path(config.model)
    with open(src / "config.json", encoding="utf-8") as f:
        raw_config = json.load(f)
    if raw_config.get("quantization_config") is not None:
        method = raw_config["quantization_config"].get("quant_method", "an unnamed method")
        raise ValueError(
            f"{src} is already quantized with {method} (quantization_config in its config.json); engine quantize "
            "takes an unquantized checkpoint."
        )
    setup = resolve_setup(config, get_plugin_manager(config.plugins).components())
    quantizer = setup.quantizer
    assert quantizer is not None
    if not _has_export(quantizer):
        raise ValueError(
            f"Quantization {quantizer.name!r} ({type(quantizer).__name__}) cannot write prequantized checkpoints: "
            "its quantizer does not implement export_weight. Quantize while loading instead (--quantization)."
        )
    written = quantizer.checkpoint_config()
    quantization_config = {**written, **config.quantization_config, "quant_method": written["quant_method"]}

    model = construct_model(setup.model_cls, setup.hf_config, setup.dtype_name, torch.device("cpu"))
    quantized, _ = quantize_model(model, quantizer)
    if not quantized:
        raise ValueError(f"Quantization {quantizer.name!r} quantizes none of {setup.architecture}'s linear layers.")
    layers = linear_layers(model)
    paths = {id(layers[path]): path for path in quantized}

    partial = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    try:
        files = safetensors_files(src)
        writer = _ShardWriter(partial, max_shard_bytes)
        streamed: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (checkpoint name, tensor)
        taken: set[str] = set()  # checkpoint names of the quantized layers' tensors
        waiting: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint module -> its tensors so far
        total = sum(len(layers[path].output_sizes) for path in quantized)
        num_experts = 0  # expert projections written quantized
        bar = tqdm(total=total, desc="Quantizing", unit="module", disable=not progress, leave=False)

        def receive(layer: MergedLinear, name: str, shard: int, tensor: torch.Tensor) -> None:
            found = streamed.get(id(tensor))
            if found is None or not found[0].endswith(f".{name}"):
                raise ValueError(
                    f"{setup.architecture}'s loader gives {paths[id(layer)]} ({name}, shard {shard}) a tensor it "
                    "made from the checkpoint's rather than one of them as stored; engine quantize writes only "
                    "layers that take checkpoint tensors as they are."
                )
            full_name = found[0]
            module = full_name[: -len(name) - 1]
            taken.add(full_name)
            tensors = waiting.setdefault(module, {})
            tensors[name] = tensor.to(layer.dtype)  # what the layer's parameter would hold
            if set(tensors) == set(layer.method.checkpoint_tensors(layer)):
                del waiting[module]
                for key, value in quantizer.export_weight(tensors["weight"], tensors.get("bias")).items():
                    writer.add(f"{module}.{key}", value)
                bar.update(1)

        for path in quantized:
            layers[path].set_method(_HandOver(receive))

        def stream():
            for name, tensor in iterate_weights(files, progress=False):
                streamed[id(tensor)] = (name, tensor)
                yield name, tensor

        with torch.inference_mode():
            model.load_weights(stream())
        bar.close()
        missing = [f"{path}.{t}" for path in quantized for t in layers[path].missing_tensors()] + [
            f"{module}.{name}" for module, tensors in waiting.items() for name in tensors
        ]
        if missing:
            raise ValueError(f"The checkpoint did not complete these quantized layers' tensors: {', '.join(missing)}.")
        kept = [(name, tensor) for name, tensor in streamed.values() if name not in taken]
        dtype = getattr(torch, setup.dtype_name)
        num_kept = 0
        for name, tensor in kept:
            experts = _expert_modules(model, quantizer, name, tensor)
            if experts is None:
                writer.add(name, tensor.clone())
                num_kept += 1
                continue
            for module, weight in experts:  # a routed expert's projection, in the method's format
                for key, value in quantizer.export_weight(weight.to(dtype), None).items():
                    writer.add(f"{module}.{key}", value)
                num_experts += 1
        written = writer.close()
        config_out = dict(raw_config, quantization_config=quantization_config)
        (partial / "config.json").write_text(json.dumps(config_out, indent=2), encoding="utf-8")
        for item in sorted(src.iterdir()):
            if (
                item.is_file()
                and item.suffix not in WEIGHT_SUFFIXES
                and item.name not in ("config.json", SAFETENSORS_INDEX)
            ):
                shutil.copy2(item, partial / item.name)
        os.replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    result = QuantizedCheckpoint(
        dst,
        quantization_config,
        setup.dtype_name,
        num_modules=total + num_experts,
        num_kept=num_kept,
        files=written,
        bytes_written=writer.total_bytes,
        source_bytes=sum(f.stat().st_size for f in files),
    )
    logger.info("%s", result.describe())
    return result
