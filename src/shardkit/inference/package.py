"""A served model as a package: weights plus a JSON description, loadable in a fresh process.

``save_package(model, path)`` writes a directory:

- ``shardkit_package.json``: the format (``"shardkit-package"``, :data:`FORMAT_VERSION`), the shardkit
  version that wrote it, the model's description (module types, table configs, layer sizes; no code) and
  the weights file's size, sha256 and tensor list (name, dtype, shape);
- ``weights.pt``: ``torch.save`` of a ``{name: tensor}`` dict, the model's state dict (quantized tables
  as their stored uint8 rows).

``load_package(path)`` checks the description, the file's size and sha256 before reading it, reads it
with ``torch.load(weights_only=True)`` (tensors only: nothing from the package is executed), builds the
model from the description and loads the weights strictly. Any mismatch is a :class:`PackageError`
(a ``ValueError``) saying what is wrong: not a package, another format version, a truncated or modified
weights file, weights of another model, or (``load_package(path, model)``) a package of another model.

Models a package can describe (:data:`SUPPORTED`): shardkit's ``EmbeddingBagCollection``,
``QuantEmbeddingBagCollection``, ``QuantEmbeddingCollection``, and ``shardkit.models.DLRM`` /
``MixedDimDLRM`` (the demo's model; no managed-collision tables) over one of the two bag collections.
Anything else is a ``TypeError`` naming it. Feature processors, managed
collision, custom ``init_fn`` s and fused optimizer settings are not described (serving needs none).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

import shardkit
from shardkit.datasets import TableSpec
from shardkit.models import DLRM, MixedDimDLRM
from shardkit.modules import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from shardkit.quant import QuantEmbeddingBagCollection, QuantEmbeddingCollection

FORMAT = "shardkit-package"
FORMAT_VERSION = 1
CONFIG_FILE = "shardkit_package.json"
WEIGHTS_FILE = "weights.pt"
SUPPORTED = (
    "EmbeddingBagCollection",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "DLRM",
    "MixedDimDLRM",
)
# MixedDimDLRM's activations a package may name (a name, never code)
_ACTIVATIONS = {"ReLU": nn.ReLU, "SiLU": nn.SiLU}
_DTYPES = {str(d).split(".")[-1]: d for d in (torch.float32, torch.float16, torch.bfloat16, torch.uint8)}


class PackageError(ValueError):
    """A package that cannot be loaded: the message says which file and what is wrong."""


# ---- describing a model ---------------------------------------------------------------------------


def _table(config: Union[EmbeddingBagConfig, EmbeddingConfig]) -> Dict[str, Any]:
    out = {
        "name": config.name,
        "num_embeddings": config.num_embeddings,
        "embedding_dim": config.embedding_dim,
        "feature_names": list(config.feature_names),
        "data_type": config.data_type.value,
    }
    if isinstance(config, EmbeddingBagConfig):
        out["pooling"] = config.pooling.value
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def describe(model: nn.Module) -> Dict[str, Any]:
    """The JSON-able description of ``model`` (``TypeError`` for a model a package cannot describe)."""
    kind = type(model).__name__
    if type(model) is QuantEmbeddingBagCollection or type(model) is EmbeddingBagCollection:
        out = {"type": kind, "is_weighted": model.is_weighted()}
        out["tables"] = [_table(c) for c in model.embedding_bag_configs()]
        if kind == "QuantEmbeddingBagCollection":
            out["output_dtype"] = _dtype_name(model.output_dtype)
        return out
    if type(model) is QuantEmbeddingCollection:
        return {
            "type": kind,
            "need_indices": model.need_indices(),
            "output_dtype": _dtype_name(model.output_dtype),
            "tables": [_table(c) for c in model.embedding_configs()],
        }
    if type(model) is DLRM:
        dense = [m for m in model.dense_arch.modules() if isinstance(m, nn.Linear)]
        over = [m for m in model.over_arch.modules() if isinstance(m, nn.Linear)]
        return {
            "type": kind,
            "embedding_bag_collection": describe(model.sparse_arch.embedding_bag_collection),
            "dense_in_features": dense[0].in_features,
            "dense_arch_layer_sizes": [m.out_features for m in dense],
            "over_arch_layer_sizes": [m.out_features for m in over],
        }
    if type(model) is MixedDimDLRM:
        activation = type(model.dense_arch[1]).__name__
        if model.mc_ebc is not None or activation not in _ACTIVATIONS:
            raise TypeError(
                "save_package: a MixedDimDLRM is described without managed-collision tables and with a "
                f"{' or '.join(_ACTIVATIONS)} activation; this one has "
                f"{'mc_ebc, ' if model.mc_ebc is not None else ''}{activation}"
            )
        return {
            "type": kind,
            "ebc": describe(model.ebc),
            "dense_in": model.dense_arch[0].in_features,
            "hidden": model.dense_arch[0].out_features,
            "dense_out": model.dense_arch[2].out_features,
            "activation": activation,
        }
    raise TypeError(
        f"save_package: a package describes {', '.join(SUPPORTED)} (DLRM over one of the bag collections); "
        f"got {kind}. A sharded model: gather it first (state_dict_gather into its unsharded twin)"
    )


def _configs(tables: List[Dict[str, Any]], bags: bool) -> list:
    out = []
    for t in tables:
        common = dict(
            num_embeddings=int(t["num_embeddings"]),
            embedding_dim=int(t["embedding_dim"]),
            name=str(t["name"]),
            feature_names=[str(f) for f in t["feature_names"]],
            data_type=DataType(t["data_type"]),
        )
        out.append(
            EmbeddingBagConfig(**common, pooling=PoolingType(t["pooling"]))
            if bags
            else EmbeddingConfig(**common)
        )
    return out


def build(description: Dict[str, Any], materialize: bool = True) -> nn.Module:
    """An empty model of ``description``: tables allocated on CPU but not initialized, dense layers
    initialized; with ``materialize=False`` the tables stay on the meta device (no memory)."""
    kind = description["type"]
    meta = torch.device("meta")
    if kind in ("EmbeddingBagCollection", "QuantEmbeddingBagCollection"):
        configs = _configs(description["tables"], bags=True)
        weighted = bool(description["is_weighted"])
        if kind == "EmbeddingBagCollection":
            module = EmbeddingBagCollection(configs, is_weighted=weighted, device=meta)
        else:
            dtype = _DTYPES[description["output_dtype"]]
            module = QuantEmbeddingBagCollection(
                configs, is_weighted=weighted, device=meta, output_dtype=dtype
            )
        return module.to_empty(device="cpu") if materialize else module
    if kind == "QuantEmbeddingCollection":
        configs = _configs(description["tables"], bags=False)
        module = QuantEmbeddingCollection(
            configs,
            device=meta,
            need_indices=bool(description["need_indices"]),
            output_dtype=_DTYPES[description["output_dtype"]],
        )
        return module.to_empty(device="cpu") if materialize else module
    if kind == "DLRM":
        return DLRM(
            build(description["embedding_bag_collection"], materialize),
            int(description["dense_in_features"]),
            [int(s) for s in description["dense_arch_layer_sizes"]],
            [int(s) for s in description["over_arch_layer_sizes"]],
        )
    if kind == "MixedDimDLRM":
        ebc = build(description["ebc"], materialize=False)
        if description["activation"] not in _ACTIVATIONS:
            raise PackageError(
                f"the package names activation {description['activation']!r}; known: {sorted(_ACTIVATIONS)}"
            )
        specs = [TableSpec(c.name, c.num_embeddings, c.embedding_dim) for c in ebc.embedding_bag_configs()]
        with torch.device("cpu"):  # its index lists are read back (.tolist()): never meta tensors
            model = MixedDimDLRM(
                specs,
                int(description["dense_in"]),
                int(description["dense_out"]),
                int(description["hidden"]),
                device=meta,
                activation=_ACTIVATIONS[description["activation"]],
            )
        model.ebc = ebc  # the described collection (quantized or float) instead of the trainable one
        return model.to_empty(device="cpu") if materialize else model
    raise PackageError(f"the package describes a {kind!r}; this shardkit builds {', '.join(SUPPORTED)}")


# ---- files ----------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_package(model: nn.Module, path: Union[str, os.PathLike]) -> Path:
    """Write ``model`` (one of :data:`SUPPORTED`, unsharded, on any device) as a package directory
    ``path`` (created; existing package files are replaced). Returns the directory."""
    description = describe(model)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights = root / WEIGHTS_FILE
    torch.save(state, weights)
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "shardkit_version": shardkit.__version__,
        "model": description,
        "weights": {
            "file": WEIGHTS_FILE,
            "bytes": weights.stat().st_size,
            "sha256": _sha256(weights),
            "tensors": {k: {"dtype": _dtype_name(v.dtype), "shape": list(v.shape)} for k, v in state.items()},
        },
    }
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return root


def _read_config(root: Path) -> Dict[str, Any]:
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise PackageError(f"{root} is not a shardkit package: it has no {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PackageError(f"{config_path} is not valid JSON (truncated or modified?): {err}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise PackageError(f"{config_path} is not a shardkit package description (no format {FORMAT!r})")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise PackageError(
            f"{root}: package format {version!r}, written by shardkit {config.get('shardkit_version')!r}; "
            f"this shardkit {shardkit.__version__} reads format {FORMAT_VERSION} only: re-export the model "
            "with this version (save_package)"
        )
    for field in ("model", "weights"):
        if not isinstance(config.get(field), dict):
            raise PackageError(f"{config_path}: the {field!r} entry is missing or not an object")
    return config


def _read_weights(root: Path, listing: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise PackageError(f"{root}: {WEIGHTS_FILE} is missing")
    size, expected = weights.stat().st_size, listing.get("bytes")
    if size != expected:
        what = "truncated" if isinstance(expected, int) and size < expected else "not the one described"
        raise PackageError(f"{weights} is {what}: {size} bytes, the package describes {expected}")
    if _sha256(weights) != listing.get("sha256"):
        raise PackageError(
            f"{weights} was modified: its sha256 differs from the package's {listing.get('sha256')}"
        )
    # weights_only: tensors and plain containers only, no object of the file is constructed by code
    state = torch.load(weights, map_location="cpu", weights_only=True)
    tensors = listing.get("tensors")
    if not isinstance(tensors, dict) or not all(isinstance(t, dict) for t in tensors.values()):
        raise PackageError(f"{root}: the package's list of tensors is missing or malformed")
    if not isinstance(state, dict) or set(state) != set(tensors):
        raise PackageError(f"{weights} does not hold the tensors the package lists")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or [_dtype_name(value.dtype), list(value.shape)] != [
            tensors[name].get("dtype"),
            tensors[name].get("shape"),
        ]:
            raise PackageError(f"{weights}: tensor {name!r} is not the {tensors[name]} the package lists")
    return state


def _differences(a: Any, b: Any, where: str = "model") -> List[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{where}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: package {a!r}, model {b!r}"]


def _check_described_shapes(root: Path, description: Dict[str, Any], state: Dict[str, torch.Tensor]) -> None:
    """The described model's state-dict tensors (built on meta: a description of absurd sizes allocates
    nothing) must be the weights' names, dtypes and shapes."""
    try:
        with torch.device("meta"):
            shapes = {
                k: (v.dtype, tuple(v.shape))
                for k, v in build(description, materialize=False).state_dict().items()
            }
    except PackageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise PackageError(f"{root}: the model description is incomplete or invalid: {err!r}") from None
    found = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
    if shapes != found:
        differ = sorted(k for k in set(shapes) | set(found) if shapes.get(k) != found.get(k))
        details = [f"{k}: weights {found.get(k)}, description {shapes.get(k)}" for k in differ[:4]]
        raise PackageError(f"{root}: the weights are not those of the described model: " + "; ".join(details))


def load_package(path: Union[str, os.PathLike], model: Optional[nn.Module] = None) -> nn.Module:
    """The model of the package at ``path``, built from its description with its weights, on CPU in
    eval mode; or, with ``model``, those weights loaded into ``model`` (which must be described the same:
    same module types, tables, data types and layer sizes). ``PackageError`` says what is wrong."""
    root = Path(path)
    config = _read_config(root)
    description = config["model"]
    if model is not None:
        differences = _differences(description, describe(model))
        if differences:
            raise PackageError(f"{root} holds another model: " + "; ".join(differences[:8]))
    state = _read_weights(root, config["weights"])
    if model is None:
        _check_described_shapes(root, description, state)
        target = build(description)
    else:
        target = model
    try:
        target.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise PackageError(f"{root}: the weights are not those of the described model: {err}") from None
    return target.eval()


__all__ = [
    "CONFIG_FILE",
    "FORMAT_VERSION",
    "PackageError",
    "SUPPORTED",
    "WEIGHTS_FILE",
    "build",
    "describe",
    "load_package",
    "save_package",
]
