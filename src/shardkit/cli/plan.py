"""``shardkit plan CONFIG``: plan a set of embedding tables for a cluster, without starting any process.

The config (JSON, or YAML when PyYAML is installed) describes the tables and the topology::

    world_size: 4                 # ranks
    memory_per_rank: 16GiB        # HBM on cuda, DDR on cpu: bytes, or a number with B/KiB/MiB/GiB/TiB/KB/...
    local_world_size: 2           # optional: ranks per node (default: one node)
    device: cuda                  # optional: cuda (default) or cpu
    disk_per_rank: 1TiB           # optional (cpu): the offload directory's disk per rank (default: unlimited)
    batch_size: 1024              # optional: samples per rank (default 512)
    optimizer: rowwise_adagrad    # optional: fused optimizer (sgd, adagrad, rowwise_adagrad, adam)
    tables:
      - {name: item, rows: 5000000, dim: 128, pooling_factor: 20}
      - {name: country, rows: 200, dim: 16, features: [home_country, ip_country]}
    constraints:                  # optional: per table, fields of ParameterConstraints
      country: {sharding_types: [data_parallel]}
      item: {compute_kernels: [fused_uvm_caching], cache_params: {load_factor: 0.1, algorithm: lru}}

The tables are built as an EmbeddingBagCollection on the meta device (no memory) and planned by
``EmbeddingShardingPlanner`` with the EmbeddingBagCollection sharder (offering the offloading kernels
``fused_uvm`` / ``fused_uvm_caching`` besides ``fused`` / ``dense``: on cpu the planner uses them only for
the tables whose constraints name them). ``cache_params`` takes the fields of ``CacheParams``
(``load_factor``, ``algorithm``, ``precision``, ``prefetch_pipeline``, ``reserved_memory``,
``offload_dir``); the printed plan lists each offloaded table's cache rows and bytes and its expected
hit rate. A malformed config is a one-line
error and exit code 2; a config whose tables fit nowhere prints the planner's explanation, exit code 1.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import sys
from pathlib import Path
from typing import Any, Dict, List

TOP_KEYS = {
    "world_size",
    "memory_per_rank",
    "local_world_size",
    "device",
    "batch_size",
    "optimizer",
    "tables",
    "constraints",
    "disk_per_rank",
}
TABLE_KEYS = {"name", "rows", "dim", "pooling_factor", "features"}
CONSTRAINT_KEYS = {
    "sharding_types",
    "compute_kernels",
    "min_partition",
    "pooling_factors",
    "batch_sizes",
    "ranks",
    "cache_params",
}
CACHE_KEYS = {"load_factor", "algorithm", "precision", "prefetch_pipeline", "reserved_memory", "offload_dir"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
# sizes checked before anything is built: a table past these is a typo, and planning it would
# enumerate (dim) or count (rows) without bound
MAX_ROWS = 1 << 48
MAX_DIM = 1 << 16
MAX_BYTES = 1 << 60
MAX_WORLD = 1 << 16
MAX_CONFIG_BYTES = 16 << 20
_MAX_MESSAGE = 300
# values quoted in errors are abbreviated: a small YAML file with nested aliases expands to gigabytes
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 60, 60


def _short(value: Any) -> str:
    return _SHORT.repr(value)


class ConfigError(ValueError):
    """A malformed plan config; the message is one line naming the offending key (at most 300 chars)."""

    def __init__(self, message: str) -> None:
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE - 3] + "..."
        super().__init__(message)


def load_config(path: str) -> Dict[str, Any]:
    """Parse ``path`` as JSON (``.json``) or YAML (anything else, which needs PyYAML)."""
    file = Path(path)
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes; a plan config is at most {MAX_CONFIG_BYTES}")
        raw = file.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start}"
        ) from None
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"{path}: reading YAML needs PyYAML (pip install 'shardkit[yaml]', or pyyaml); "
                "or give a .json file"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the config must be a mapping with 'tables', 'world_size', 'memory_per_rank'"
        )
    return data


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"JSON {name} is not a number a config can use")


def _finite(value: Any, key: str) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {_short(value)}")
    return value


def parse_bytes(value: Any, key: str) -> int:
    """``value`` as a byte count: an int / float, or a string such as ``"16GiB"`` or ``"512 MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key} must be a byte count such as 16GiB, got {_short(value)}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(rf"\s*({_NUMBER})\s*([A-Za-z]*)\s*", value[:100])
        if match is None or match.group(2).upper() not in _UNITS:
            raise ConfigError(f"{key} must be a byte count such as 16GiB, got {_short(value)}")
        number, unit = float(match.group(1)), match.group(2).upper()
    _finite(number, key)
    if number < 0:
        raise ConfigError(f"{key} must not be negative, got {_short(value)}")
    total = number * _UNITS[unit]
    if total > MAX_BYTES:
        raise ConfigError(f"{key} is {_short(value)}, more than {MAX_BYTES} bytes")
    return int(total)


def _expect(value: Any, kinds: tuple, key: str, what: str) -> Any:
    # bool is an int subclass, but `rows: true` is a mistake, not a row count
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ConfigError(f"{key} must be {what}, got {_short(value)}")
    if isinstance(value, float):
        _finite(value, key)
    return value


def _positive_int(value: Any, key: str, limit: int = MAX_ROWS) -> int:
    if _expect(value, (int,), key, "a positive integer") < 1:
        raise ConfigError(f"{key} must be a positive integer, got {_short(value)}")
    if value > limit:
        raise ConfigError(f"{key} is {value}, more than the largest supported ({limit})")
    return value


def _unknown(keys, known: set, where: str) -> None:
    extra = sorted(set(keys) - known)
    if extra:
        raise ConfigError(f"{where}: unknown key {_short(extra[0])}; known: {', '.join(sorted(known))}")


def _number_list(value: Any, key: str) -> List[float]:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if _expect(v, (int, float), key, "a number or a list of numbers") < 0:
            raise ConfigError(f"{key} must not be negative, got {_short(v)}")
    return [float(v) for v in values]


def _topology(config: Dict[str, Any]):
    from shardkit.planner import Topology

    world = _positive_int(config["world_size"], "world_size", MAX_WORLD)
    local = config.get("local_world_size")
    if local is not None and (_positive_int(local, "local_world_size") > world or world % local):
        raise ConfigError(f"local_world_size {local} must divide world_size {world}")
    device = config.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device must be cuda or cpu, got {_short(device)}")
    memory = parse_bytes(config["memory_per_rank"], "memory_per_rank")
    caps = {"hbm_cap": memory} if device == "cuda" else {"ddr_cap": memory}
    if config.get("disk_per_rank") is not None:
        if device != "cpu":
            raise ConfigError("disk_per_rank is the cpu offload tier; on cuda the slow tier is host memory")
        caps["disk_cap"] = parse_bytes(config["disk_per_rank"], "disk_per_rank")
    return Topology(world_size=world, compute_device=device, local_world_size=local, **caps)


def _tables(config: Dict[str, Any]):
    """The ``EmbeddingBagConfig`` list, and ``{table: {"pooling_factors": [...]}}`` where given."""
    from shardkit.modules import EmbeddingBagConfig

    tables_cfg = _expect(config["tables"], (list,), "tables", "a list of tables")
    if not tables_cfg:
        raise ConfigError("tables: the list is empty")
    tables, pooling = [], {}
    for i, t in enumerate(tables_cfg):
        where = f"tables[{i}]"
        _expect(t, (dict,), where, "a mapping with name, rows, dim")
        _unknown(t, TABLE_KEYS, where)
        for key in ("name", "rows", "dim"):
            if key not in t:
                raise ConfigError(f"{where}: missing key {key!r}")
        name = _expect(t["name"], (str,), f"{where}.name", "a string")
        where = f"table {name!r}"
        features = _expect(t.get("features", [name]), (list,), f"{where} features", "a list of feature names")
        tables.append(
            EmbeddingBagConfig(
                num_embeddings=_positive_int(t["rows"], f"{where} rows"),
                embedding_dim=_positive_int(t["dim"], f"{where} dim", MAX_DIM),
                name=name,
                feature_names=[
                    _expect(f, (str,), f"{where} features", "a list of strings") for f in features
                ],
            )
        )
        if "pooling_factor" in t:
            pooling[name] = {"pooling_factors": _number_list(t["pooling_factor"], f"{where} pooling_factor")}
    return tables, pooling


def _constraints(config: Dict[str, Any], names: set, pooling: Dict[str, dict], world: int):
    """``{table: ParameterConstraints}`` from the config's constraints and the tables' pooling factors."""
    from shardkit.planner import ParameterConstraints
    from shardkit.sharding.types import EmbeddingComputeKernel, ShardingType

    merged = {name: dict(c) for name, c in pooling.items()}
    given = _expect(
        config.get("constraints", {}), (dict,), "constraints", "a mapping of table name to constraints"
    )
    for name, c in given.items():
        if name not in names:
            raise ConfigError(f"constraints: no table named {_short(name)}")
        _expect(c, (dict,), f"constraints of {name!r}", "a mapping")
        _unknown(c, CONSTRAINT_KEYS, f"constraints of {name!r}")
        merged.setdefault(name, {}).update(c)
    known = {
        "sharding_types": [t.value for t in ShardingType],
        "compute_kernels": [k.value for k in EmbeddingComputeKernel],
    }
    result = {}
    for name, c in merged.items():
        where = f"constraints of {name!r}"
        for key, values in known.items():
            for v in _expect(c.get(key, []), (list,), f"{where} {key}", "a list"):
                if v not in values:
                    what = key[:-1].replace("_", " ")
                    raise ConfigError(f"{where}: unknown {what} {_short(v)}; known: {', '.join(values)}")
        if "pooling_factors" in c:
            c["pooling_factors"] = _number_list(c["pooling_factors"], f"{where} pooling_factors")
        for key in ("batch_sizes", "ranks"):
            for v in _expect(c.get(key, []), (list,), f"{where} {key}", "a list of integers"):
                _expect(v, (int,), f"{where} {key}", "a list of integers")
        if "min_partition" in c:
            _positive_int(c["min_partition"], f"{where} min_partition")
        if any(not 0 <= r < world for r in c.get("ranks", [])):
            raise ConfigError(f"{where}: ranks {c['ranks']} outside 0..{world - 1}")
        if "cache_params" in c:
            c["cache_params"] = _cache_params(c["cache_params"], where)
        try:
            result[name] = ParameterConstraints(**c)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return result


def _cache_params(value: Any, where: str):
    """A ``CacheParams`` from a constraint's ``cache_params`` mapping."""
    from shardkit.sharding.cache_params import CacheParams

    _expect(value, (dict,), f"{where} cache_params", "a mapping")
    _unknown(value, CACHE_KEYS, f"{where} cache_params")
    try:
        return CacheParams(**value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None


def build(config: Dict[str, Any]):
    """``(planner, module, sharders)`` for a parsed config; ``ConfigError`` names what is wrong."""
    import torch

    from shardkit.modules import EmbeddingBagCollection, FusedOptimizerConfig, OptimType
    from shardkit.planner import EmbeddingShardingPlanner
    from shardkit.sharding.embeddingbag import EmbeddingBagCollectionSharder

    _unknown(config, TOP_KEYS, "config")
    for key in ("tables", "world_size", "memory_per_rank"):
        if key not in config:
            raise ConfigError(f"config: missing key {key!r}")
    topology = _topology(config)
    batch_size = _positive_int(config.get("batch_size", 512), "batch_size")
    fused = None
    if config.get("optimizer") is not None:
        optimizers = {t.value.lower(): t for t in OptimType}
        name = str(config["optimizer"])[:100].lower()
        if name not in optimizers:
            raise ConfigError(
                f"optimizer: unknown {_short(config['optimizer'])}; known: {', '.join(sorted(optimizers))}"
            )
        fused = FusedOptimizerConfig(optimizers[name])
    tables, pooling = _tables(config)
    constraints = _constraints(config, {t.name for t in tables}, pooling, topology.world_size)
    try:
        module = EmbeddingBagCollection(tables, device=torch.device("meta"), fused_optimizer=fused)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"tables: {err}") from None
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints)
    return planner, module, [EmbeddingBagCollectionSharder()]


def run(args) -> int:
    from shardkit.planner import PlannerError

    try:
        planner, module, sharders = build(load_config(args.config))
    except ConfigError as err:
        print(f"shardkit plan: error: {err}", file=sys.stderr)
        return 2
    try:
        _, report = planner.plan_with_report(module, sharders)
    except PlannerError as err:
        print(f"shardkit plan: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(report.to_json())
        return 0
    t = planner.topology
    nodes = f", {t.num_nodes} nodes of {t.local_world_size}" if t.num_nodes > 1 else ""
    print(f"plan for {len(report.tables)} tables on {t.world_size} {t.compute_device} ranks{nodes}")
    print(report)
    return 0


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "plan", help="plan embedding tables for a cluster and print the per-rank load"
    )
    parser.add_argument("config", help="tables and topology, YAML (needs PyYAML) or .json")
    parser.add_argument("--json", action="store_true", help="print the plan report as JSON")
    parser.set_defaults(run=run)
