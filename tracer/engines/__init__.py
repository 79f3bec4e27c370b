"""Engines: the ways tracer executes a run plan, one folder each, behind one door.

An engine executes a :class:`~tracer.plan.plans.RunPlan` on the loaded model's weights and hands
back what its modules computed, under HF module names. The house::

    tracer/engines/table.py    the table of engines, as data: name, package, label, defaults,
                               scenarios and roles, how a run chooses it (every stage reads it)
    tracer/engines/base.py     the protocol: realise a scenario, execute a plan, report facts
    tracer/engines/door.py     the door: the only module outside this package that reaches an
                               engine's folder (it imports ``tracer.engines.<name>`` by the table)
    tracer/engines/<name>/     one folder per engine (``hf``, ``tp``, ...): its ``ENGINE``, run,
                               capture, requests or plan realisation, facts
    tracer/engines/dumps/      files other engines wrote (dump formats) and their name maps

Adding an engine is one folder here and one row of the table (``docs/ARCHITECTURE.md``).
"""
