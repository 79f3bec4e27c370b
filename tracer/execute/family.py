"""Model families as data: the descriptors in ``hooks/*.toml``.

A **family descriptor** (one TOML file, ``hooks/README.md``) names, for the ``config.model_type``
values it lists, the HF module paths of the embedding, the decoder-layer list, the final norm and
the LM head, and, inside a decoder layer, the module that plays each **role** of a transformer
block (:data:`tracer.execute.roles.ROLES`: the attention and its norm, the q/k/v/o projections or a
fused qkv, the MLP and its norm, gate/up/down or a fused gate_up, the activation, post-norms).
Everything else in tracer reads module names from the descriptor or from the role each capture
point carries (:attr:`tracer.execute.points.CapturePoint.role`, stored in the trace): capture
discovery, the dataflow of the origin analysis (:data:`tracer.execute.roles.DATAFLOW`, over roles),
tensor-parallel sharding (which roles are column- and row-parallel), engine maps.

Descriptors are read from the folders of ``$TRACER_HOOKS_PATH`` (``os.pathsep``-separated; a
descriptor there wins over a built-in one for the same model type) and then from tracer's own
``hooks/`` folder. Files named ``engine-*.toml`` are engine dump maps (:func:`engine_map_files`),
not family descriptors.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

from tracer import schema
from tracer.errors import TracerError
from tracer.execute.inferred import model_paths
from tracer.execute.kinds import PointKind
from tracer.execute.roles import ROLES
from tracer.files import read_text_file
from tracer.load.recipe_check import check_hook_map
from tracer.load.recipes import data_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

#: environment variable: extra folders of family descriptors (and engine maps), searched first
HOOKS_PATH_ENV = "TRACER_HOOKS_PATH"

_MODEL_KEYS = ("embedding", "layers", "final_norm", "logits")
#: the ``[sublayers]`` kind of a module not captured at all (nor anything inside it)
SKIP = "skip"


@dataclass(frozen=True)
class Sliding:
    """How a config marks sliding-window layers: ``config.<types>[i]`` equal to one of ``values``
    makes layer i sliding-window, with a window of ``config.<window>`` tokens."""

    types: str = "layer_types"
    values: tuple[str, ...] = ("sliding_attention",)
    window: str = "sliding_window"

    @property
    def spec(self) -> tuple[str, tuple[str, ...], str]:
        """``(types, values, window)``, as :func:`tracer.load.contract.attention_kinds` takes it."""
        return (self.types, self.values, self.window)


@dataclass(frozen=True)
class FamilyFacts(schema.Record):
    """What a trace header records about the model's family (its ``family``): the descriptor's name
    and file, the model types it applies to, the module paths and every role's path in a layer;
    ``inferred``: the note saying the layer-level paths were inferred (no descriptor fits), else None."""

    name: str | None = None
    descriptor: str | None = None
    model_types: tuple[str, ...] = ()
    embedding: str | None = None
    layers: str | None = None
    final_norm: str | None = None
    logits: str | None = None
    roles: dict[str, str] = field(default_factory=dict)
    inferred: str | None = None


@dataclass(frozen=True)
class Family:
    """One family descriptor (``hooks/<name>.toml``), validated.

    Attributes:
        name: the file's stem (``llama``).
        path: the file it was read from (named in every error about it).
        model_types: the ``config.model_type`` values it applies to.
        embedding, layers, final_norm, logits: HF module paths (``model.embed_tokens``,
            ``model.layers`` = the ``nn.ModuleList`` of decoder layers, ``model.norm``, ``lm_head``).
        roles: role → module path relative to a decoder layer (``"o_proj": "self_attn.o_proj"``).
        optional: roles a model of the family may lack (Qwen3's ``q_norm``; Llama has none).
        sublayers: extra modules inside a layer → capture kind (captured, no role: the dataflow
            treats them conservatively).
        skip: modules inside a layer that are not captured, nor anything inside them
            (``[sublayers]`` kind ``skip``: an MoE block's router and experts, whose outputs hold the
            tokens of the whole batch flattened, ``(B * T, features)``).
        sliding: how the config marks sliding-window layers.
        inferred: for a family no descriptor lists or fits, inferred from the model's modules
            (:func:`infer_family`: the four model-level paths, no roles): the one line saying so and
            that sublayer roles need a descriptor; ``""`` for a descriptor read from a file.
    """

    name: str
    path: str
    model_types: tuple[str, ...]
    embedding: str
    layers: str
    final_norm: str
    logits: str
    roles: Mapping[str, str] = field(default_factory=dict)
    optional: frozenset[str] = frozenset()
    sublayers: Mapping[str, PointKind] = field(default_factory=dict)
    sliding: Sliding = Sliding()
    inferred: str = ""
    skip: frozenset[str] = frozenset()

    def path_of(self, role: str) -> str | None:
        """The layer-relative path of ``role`` (None when the family has no such role)."""
        return self.roles.get(role)

    def role_of(self, rel: str) -> str | None:
        """The role of the layer-relative module path ``rel`` (None for a module without one)."""
        return self._by_path.get(rel)

    @property
    def _by_path(self) -> dict[str, str]:
        return {p: r for r, p in self.roles.items()}

    def kind_of(self, rel: str) -> PointKind | None:
        """The capture kind of a module inside a decoder layer: its role's kind, else the
        ``[sublayers]`` entry, else None."""
        role = self.role_of(rel)
        return ROLES[role] if role is not None else self.sublayers.get(rel)

    def skips(self, rel: str) -> bool:
        """Whether the module at layer-relative path ``rel`` lies in a ``skip`` subtree."""
        return any(rel == s or rel.startswith(s + ".") for s in self.skip)

    def to_dict(self) -> dict[str, Any]:
        """What the trace header records about the family: a :class:`FamilyFacts` document."""
        return FamilyFacts(self.name, str(self.path), tuple(self.model_types), self.embedding, self.layers,
                           self.final_norm, self.logits, dict(self.roles), self.inferred or None).to_dict()


def _bad(path: Any, what: str) -> TracerError:
    return TracerError(f"family descriptor {path}: {what}; fix the file (see hooks/README.md)")


def parse_family(data: dict[str, Any], path: str | Path) -> Family:
    """A :class:`Family` from a descriptor's parsed TOML (``path`` names it in errors).

    Raises:
        TracerError: a key of the wrong form (:func:`tracer.load.recipe_check.check_hook_map`),
            no ``families``, a missing model-level path, an unknown role, a module given two roles,
            an optional role that is not a role, a ``[sublayers]`` kind that is not a capture kind.
    """
    check_hook_map(data, path)
    if not data.get("families"):
        raise _bad(path, "it lists no families (config.model_type values)")
    missing = [k for k in _MODEL_KEYS if k not in data]
    if missing:
        raise _bad(path, f"it does not name {', '.join(missing)} (module paths of the model)")
    roles = dict(data.get("roles", {}))
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise _bad(path, f"unknown role {unknown[0]!r} in [roles] (roles: {', '.join(ROLES)})")
    twice = sorted({p for p in roles.values() if list(roles.values()).count(p) > 1})
    if twice:
        raise _bad(path, f"{twice[0]!r} plays two roles in [roles]; give each module one role")
    optional = frozenset(data.get("optional", ()))
    if optional - set(roles):
        raise _bad(path, f"optional names {sorted(optional - set(roles))[0]!r}, which is not in [roles]")
    kinds = set(ROLES.values())
    sublayers = dict(data.get("sublayers", {}))
    skip = frozenset(rel for rel, kind in sublayers.items() if kind == SKIP)
    for rel in skip:
        del sublayers[rel]
    for rel, kind in sublayers.items():
        if kind not in kinds:
            raise _bad(path, f"[sublayers] {rel!r} has kind {kind!r}; kinds: {', '.join(sorted(kinds))}, {SKIP}")
        sublayers[rel] = PointKind(kind)
    sl = data.get("sliding", {})
    sliding = Sliding(types=sl.get("types", "layer_types"), values=tuple(sl.get("values", ("sliding_attention",))),
                      window=sl.get("window", "sliding_window"))
    return Family(name=Path(path).stem, path=str(path), model_types=tuple(data["families"]),
                  embedding=data["embedding"], layers=data["layers"], final_norm=data["final_norm"],
                  logits=data["logits"], roles=roles, optional=optional, sublayers=sublayers, sliding=sliding,
                  skip=skip)


def hook_dirs() -> tuple[Path, ...]:
    """The folders searched for descriptors, in order: ``$TRACER_HOOKS_PATH``'s, then ``hooks/``.

    Raises:
        TracerError: a folder of ``$TRACER_HOOKS_PATH`` that does not exist.
    """
    extra = []
    for part in filter(None, os.environ.get(HOOKS_PATH_ENV, "").split(os.pathsep)):
        p = Path(part).expanduser()
        if not p.is_dir():
            raise TracerError(f"${HOOKS_PATH_ENV} names {part!r}, which is not a folder; fix the variable")
        extra.append(p.resolve())
    return (*extra, data_dir("hooks"))


def descriptors() -> tuple[Family, ...]:
    """Every family descriptor on the search path (:func:`hook_dirs`), earlier folders first.

    Raises:
        TracerError: an unreadable or invalid descriptor (naming the file), or two descriptors in
            one folder claiming the same model type.
    """
    return _descriptors(hook_dirs())


@lru_cache(maxsize=8)
def _descriptors(dirs: tuple[Path, ...]) -> tuple[Family, ...]:
    out: list[Family] = []
    for folder in dirs:
        claimed: dict[str, str] = {}
        for path in sorted(folder.glob("*.toml")):
            if path.name.startswith("engine-"):
                continue
            try:
                data = tomllib.loads(read_text_file(path, "family descriptor"))
            except tomllib.TOMLDecodeError as exc:
                raise TracerError(f"family descriptor {path} is not valid TOML ({exc}); fix or delete the file") from None
            fam = parse_family(data, path)
            for t in fam.model_types:
                if t in claimed:
                    raise _bad(path, f"model type {t!r} is claimed by {claimed[t]} too; keep one")
                claimed[t] = str(path)
            out.append(fam)
    return tuple(out)


def _layer_list(model: Any, fam: Family, modules: Mapping[str, Any]) -> Any:
    from torch import nn

    lst = modules.get(fam.layers)
    if not isinstance(lst, nn.ModuleList) or len(lst) == 0:
        what = "does not have it" if lst is None else f"has a {type(lst).__name__} there, not a list of layers"
        raise _bad(fam.path, f"layers = {fam.layers!r}, but {type(model).__name__} {what}")
    return lst


def check_family(model: Any, fam: Family, modules: Mapping[str, Any] | None = None) -> None:
    """Check that ``model`` has every path ``fam`` names (optional roles may be absent).

    Raises:
        TracerError: the first path the model lacks, naming the descriptor file.
    """
    modules = dict(model.named_modules()) if modules is None else modules
    for key in ("embedding", "final_norm", "logits"):
        if getattr(fam, key) not in modules:
            raise _bad(fam.path, f"{key} = {getattr(fam, key)!r}, which {type(model).__name__} does not have")
    layer_list = _layer_list(model, fam, modules)
    mixers = [fam.roles[r] for r in ("attention", "linear_attention") if r in fam.roles]
    for i in range(len(layer_list)):
        prefix = f"{fam.layers}.{i}"
        for role, rel in fam.roles.items():
            if role not in fam.optional and f"{prefix}.{rel}" not in modules:
                raise _bad(fam.path, f"role {role} = {rel!r}, but {prefix} of {type(model).__name__} has no {rel}; "
                                     "mark the role optional or fix the path")
        if mixers and not any(f"{prefix}.{rel}" in modules for rel in mixers):  # hybrids: each mixer optional
            raise _bad(fam.path, f"{prefix} of {type(model).__name__} has none of its token mixers "
                                 f"({', '.join(mixers)}); fix the paths")


def _fits(model: Any, fam: Family, modules: Mapping[str, Any]) -> bool:
    """Whether a model no descriptor lists has every path ``fam`` names, and (a hybrid descriptor,
    whose mixers are optional) each of its token mixers in some layer: a descriptor of optional
    roles must not claim a model that merely has its norms."""
    try:
        check_family(model, fam, modules)
    except TracerError:
        return False
    mixers = [fam.roles[r] for r in ("attention", "linear_attention") if r in fam.roles and r in fam.optional]
    n = len(modules[fam.layers])
    return all(any(f"{fam.layers}.{i}.{rel}" in modules for i in range(n)) for rel in mixers)


#: model → ((search path, model type), its descriptor): every run asks again, and the answer only
#: changes with the search path or the model type (finding it walks the whole module tree)
_FOUND: "weakref.WeakKeyDictionary[Any, tuple[tuple, Family]]" = weakref.WeakKeyDictionary()


def family_for(model: Any, modules: Mapping[str, Any] | None = None) -> Family:
    """The descriptor of ``model``: the one whose ``families`` list its ``config.model_type``, else
    the first whose every path the model has (a family of known layout under another name).
    Remembered per model until the search path (:func:`hook_dirs`) or the model type changes.

    Raises:
        TracerError: the listing descriptor names a path the model lacks (naming the file), or no
            descriptor fits (naming the closest one and what the model lacks there).
    """
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    key = (hook_dirs(), model_type)
    try:
        hit = _FOUND.get(model)
    except TypeError:  # not weakly referenceable
        hit = None
    if hit is not None and hit[0] == key:
        return hit[1]
    fam = _find_family(model, model_type, dict(model.named_modules()) if modules is None else modules)
    try:
        _FOUND[model] = (key, fam)
    except TypeError:
        pass
    return fam


def _find_family(model: Any, model_type: str, modules: Mapping[str, Any]) -> Family:
    fams = descriptors()
    listed = next((f for f in fams if model_type in f.model_types), None)
    if listed is not None:
        check_family(model, listed, modules)
        return listed
    fitting = next((f for f in fams if _fits(model, f, modules)), None)
    if fitting is not None:
        return fitting
    scores = [(sum(1 for r in f.roles.values() if any(n.endswith("." + r) for n in modules)), f) for f in fams]
    best = max(scores, key=lambda s: s[0])[1] if scores else None
    why = ""
    if best is not None:
        try:
            check_family(model, best, modules)
        except TracerError as e:
            why = f" (closest: {best.path}: {str(e).split(': ', 1)[-1].split('; fix')[0]})"
    head = f"no family descriptor for model type {model_type!r} ({type(model).__name__})"
    fix = f"write one TOML file for it (hooks/README.md) into a folder named by ${HOOKS_PATH_ENV}"
    inferred = infer_family(model, model_type, modules)
    if inferred is None:
        raise TracerError(f"{head}{why}, and its embedding, decoder layers, final norm and LM head could not "
                          f"be inferred; {fix}")
    note = (f"{head}: layer-level capture inferred ({inferred.embedding}, {inferred.layers}, {inferred.final_norm}, "
            f"{inferred.logits}); --granularity sublayers needs a descriptor (the roles of a layer's modules){why}; "
            f"{fix}")
    return replace(inferred, inferred=note)


def infer_family(model: Any, model_type: str = "", modules: Mapping[str, Any] | None = None) -> Family | None:
    """The layer-level family of an HF causal LM that no descriptor lists: the four model-level paths
    inferred from its modules (:func:`tracer.execute.inferred.model_paths`), no roles; enough for
    ``--granularity layers``, whose points are those four and the layers' outputs (and caches).
    None when any of the four is not found."""
    paths = model_paths(model, dict(model.named_modules()) if modules is None else modules)
    if paths is None:
        return None
    embedding, layers, final_norm, logits = paths
    return Family(name="inferred", path="(inferred from the model's modules)", model_types=(model_type,),
                  embedding=embedding, layers=layers, final_norm=final_norm, logits=logits)


def role_modules(model: Any, roles: Iterable[str], fam: Family | None = None) -> list[tuple[str, str, Any]]:
    """``(module path, role, module)`` of every decoder layer's module playing one of ``roles``,
    layer by layer in the order of ``roles`` (``fam``: the model's descriptor, found when None).

    Raises:
        TracerError: no descriptor fits the model (:func:`family_for`).
    """
    modules = dict(model.named_modules())
    fam = family_for(model, modules) if fam is None else fam
    out = []
    for i in range(len(modules[fam.layers])):
        for role in roles:
            rel = fam.path_of(role)
            path = f"{fam.layers}.{i}.{rel}"
            if rel is not None and path in modules:
                out.append((path, role, modules[path]))
    return out


def infer_roles(rels: Iterable[str]) -> dict[str, str]:
    """Roles of a decoder layer's capture points known by their layer-relative names only (a trace
    written before roles were stored): the roles of the descriptor that knows the most of these
    names; ``{}`` when none knows any.

    Args:
        rels: capture names relative to the layer (``self_attn.q_proj``; ``self_attn.core``,
            ``self_attn.kv_cache``, ``mlp.down_proj.input`` for the virtual points).
    """
    rels = list(rels)
    best: tuple[int, int] = (0, 0)
    out: dict[str, str] = {}
    for fam in descriptors():
        roles = {rel: fam.role_of(rel) for rel in rels}
        attn, down = fam.path_of("attention"), fam.path_of("down_proj")
        if attn is not None:
            roles.update({f"{attn}.core": "attention_core", f"{attn}.kv_cache": "kv_cache"})
        if down is not None:
            roles[f"{down}.input"] = "mlp_hidden"
        found = {rel: roles[rel] for rel in rels if roles.get(rel)}
        # the most names known; on a tie, the fewest required modules these names lack
        lacking = sum(1 for r, p in fam.roles.items() if r not in fam.optional and p not in rels)
        score = (len(found), -lacking)
        if found and (not out or score > best):
            best, out = score, found
    return out


def layout_facts(header: Mapping[str, Any]) -> dict[str, str]:
    """``{"layers_path", "attention_path"}`` of the model a trace header describes (for reports:
    which rows belong to a decoder layer and its attention), from the header's ``family`` record,
    or, for a trace written before it was recorded, from the descriptor listing the header's
    model type; ``{}`` when neither says.
    """
    fam = header.get("family") if isinstance(header.get("family"), Mapping) else None
    if fam is None:
        model = header.get("model") if isinstance(header.get("model"), Mapping) else {}
        try:
            known = next((f for f in descriptors() if model.get("family") in f.model_types), None)
        except TracerError:
            known = None
        fam = known.to_dict() if known is not None else None
    if not fam or not isinstance(fam.get("layers"), str):
        return {}
    roles = fam.get("roles") if isinstance(fam.get("roles"), Mapping) else {}
    attention = roles.get("attention")
    return {"layers_path": fam["layers"], **({"attention_path": attention} if isinstance(attention, str) else {})}


def engine_map_files(family: str, engine: str | None = None) -> list[Path]:
    """The engine dump maps (``engine-*.toml`` on the search path, :func:`hook_dirs`) for the model
    type ``family``: the generic one (its ``[engine]`` table has no ``engine`` key: the module tree
    serving engines share) and, when ``engine`` is given, that engine's own (``engine = "<name>"``),
    in that order; the first of each kind on the search path wins.

    Raises:
        TracerError: an unreadable map.
    """
    generic: Path | None = None
    specific: Path | None = None
    for folder in hook_dirs():
        for path in sorted(folder.glob("engine-*.toml")):
            try:
                data = tomllib.loads(read_text_file(path, "engine map"))
            except tomllib.TOMLDecodeError as exc:
                raise TracerError(f"engine map {path} is not valid TOML ({exc}); fix the file") from None
            head = data.get("engine") if isinstance(data.get("engine"), dict) else {}
            if family not in head.get("families", ()):
                continue
            if "engine" not in head and generic is None:
                generic = path
            elif engine is not None and head.get("engine") == engine and specific is None:
                specific = path
    return [p for p in (generic, specific) if p is not None]


__all__ = ["HOOKS_PATH_ENV", "Sliding", "Family", "parse_family", "hook_dirs", "descriptors", "check_family",
           "family_for", "infer_family", "role_modules", "infer_roles", "layout_facts", "engine_map_files", "SKIP"]
