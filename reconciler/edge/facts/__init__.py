"""Every read of a node, as facts: a shell fragment beside the parser of what it prints (`base.Fact`), one module
per subject (pyinfra's `facts/*.py`). One also writes, once: the head's cluster id (`host.identity_fact`), the
reconciler's own bookkeeping beside its lease.

The probe (`edge.observe`) is a list of facts joined into one script per node per cycle and parsed fact by fact
from its sections; a step that must read the same fact again right before acting (a link's state, MemAvailable,
the serving API, one container) reads the same `Fact` (`Fact.read`). So the probe and the steps can never disagree
on what a node said. A fact one deployment reads in a file of several takes that deployment's section prefix
(`Fact.under`): the same fact, never a second script.

Only tools a stock DGX OS has: the docker CLI (or the engine's socket via curl), `ip -j`, cat of /sys and /proc,
curl. A new fact goes in the module of its subject (a new subject: a new module), its fragment and parser beside
each other and the `Fact` of them last; the probe reads it once it is in `observe.probe_facts`.
"""
