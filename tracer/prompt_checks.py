"""A run's prompt against its model and scenario: the tokenizer's checks before the weights load,
the prompt's token ids, and the positions the scenario needs against the model's.

:func:`check_prompt_length` tokenizes a text prompt with the tokenizer alone and plans the scenario
for its N, so a bad ``--split-at`` costs no model load; :func:`needs_tokenizer` says whether a run
uses the tokenizer at all; :func:`prompt_ids` gives the token ids of a loaded model's prompt and
:func:`check_prompt_positions` refuses more positions than the model has. The orchestration
(:mod:`tracer.pipeline`) and its loops (:mod:`tracer.loops.audit`, :mod:`tracer.loops.sweep`) call them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tracer.config import RunConfig
from tracer.load.models import LoadedModel, tokenizer_only
from tracer.load.prompts import read_prompt, tokenize
from tracer.plan.build import check_resources, make_scenario
from tracer.plan.checks import check_positions, own_params, positions_needed

if TYPE_CHECKING:
    from tracer.plan.plans import Scenario


def check_prompt_length(cfg: RunConfig, length: int | None = None) -> Any:
    """The checks that need only the tokenizer, before the weights load: a text prompt is tokenized with
    the model's tokenizer alone (:func:`tracer.load.models.tokenizer_only`) and the scenario planned for
    its N, so ``--split-at`` or ``--block-size`` beyond the prompt is refused in seconds, not after the
    model loads (a prompt given as token ids was checked against N by :func:`tracer.validate.validate`).

    Returns:
        the tokenizer when one was loaded for this (:func:`tracer.pipeline.load` reuses it), else None
        (token ids, a scenario given as an object, or a tokenizer only the load can give).

    Raises:
        TracerError: what planning the scenario for this N refuses.
    """
    p = cfg.prompt
    if not needs_tokenizer(cfg) or p.token_ids is not None or p.token_ids_file is not None:
        return None
    tok = tokenizer_only(cfg.model.name, cfg.model.gguf) if isinstance(cfg.model.name, str) else None
    if tok is None:
        return None
    text, ids = read_prompt(p.prompt, p.prompt_file, p.token_ids_file, p.token_ids)
    n = len(tokenize(tok, text, ids, chat=p.chat, vocab_size=len(tok), length=p.length if length is None else length))
    if isinstance(cfg.scenario.name, str):
        from tracer.engines.door import realise

        check_resources(realise(make_scenario(cfg.scenario.name, n, cfg.scenario.params()), cfg.scenario.engine))
    return tok


def needs_tokenizer(cfg: RunConfig) -> bool:
    """Whether a run of ``cfg`` uses the tokenizer: a text prompt (the built-in one included), the
    chat template, or ``decode`` (the replay shows the continuations as text). A prompt given as
    token ids needs none, so a GGUF's tokenizer is then not converted (:func:`~tracer.load.models.load_model`)."""
    p = cfg.prompt
    return (p.token_ids is None and p.token_ids_file is None) or p.chat or cfg.checks.decode > 0


def prompt_ids(cfg: RunConfig, loaded: LoadedModel, length: int | None = None, *, scen: Scenario | None = None,
               check: bool = True) -> list[int]:
    """The prompt's token ids (``length`` overrides ``cfg.prompt.length``), with the positions
    they need checked against the model's (:func:`check_prompt_positions`: for ``scen``, else for
    the scenario ``cfg`` names) unless ``check`` is False.

    Raises:
        TracerError: unreadable prompt files, ids outside the vocabulary, empty prompt, more
            positions than the model has.
    """
    p = cfg.prompt
    text, ids = read_prompt(p.prompt, p.prompt_file, p.token_ids_file, p.token_ids)
    ids = tokenize(loaded.tokenizer, text, ids, chat=p.chat, vocab_size=loaded.info.vocab_size,
                   length=p.length if length is None else length)
    if check:
        check_prompt_positions(cfg, loaded, len(ids), scen)
    return ids


def check_prompt_positions(cfg: RunConfig, loaded: Any, n: int, scen: Scenario | None = None) -> None:
    """The positions the scenario needs for this N against the model's
    (:func:`tracer.plan.checks.check_positions`); a note on stderr when only RoPE scaling makes
    them legitimate. ``scen``: the scenario planned for N (default: the one ``cfg`` names, built
    for N: :func:`tracer.plan.build.make_scenario` gives the same object to the run that plans it).

    Raises:
        TracerError: more positions than the model has.
    """
    config = getattr(loaded.model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    limit = next((getattr(text, k) for k in ("max_position_embeddings", "n_positions", "n_ctx")
                  if isinstance(getattr(text, k, None), int)), None)
    name = cfg.scenario.name
    if scen is None and isinstance(name, str):
        scen = make_scenario(name, n, own_params(name, cfg.scenario.params()))
    need = positions_needed(scen, n, cfg.checks.decode) if scen is not None else n + cfg.checks.decode
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default")
    note = check_positions(need, limit, scaled, loaded.info.name)
    if note is not None:
        sys.stderr.write(note + "\n")


__all__ = ["check_prompt_length", "needs_tokenizer", "prompt_ids", "check_prompt_positions"]
