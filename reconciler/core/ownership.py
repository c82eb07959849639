"""Whose a container is: the one place that says which instance label new containers get and which labels are
this cluster's. Pure.

The cluster is named by its head's cluster id (`ClusterIdentity`, read by the head's probe from
`~/.spark-reconciler/cluster-id`), not by the head's SSH address: an address changes (DHCP renumbering, a move to
the head's `.local` name) while the machine and its running containers stay, and naming the cluster by it made
both containers "another reconciler's" until someone removed them by hand (issue 29, finding 7). Containers
labelled with a name the head was known as before the id existed (`known_as`, the `host:port` of then) are
adopted. Where the id is not known (an older snapshot, or the head could not be read) the cluster is its head's
SSH address, as before the id existed.

Whose one container is, given the `Owner`, is judged on its labels alone by `observed.whose` (and `owned_by`,
`is_managed` over it), there beside the labels: the plan reads them from the probe's container list, a step from
`docker inspect` right before it acts, and both ask the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reconciler.core.observed import KNOWN_AS_PATTERN, Observed
from reconciler.core.spec import Desired

#: Where the id lives on the head, for messages (the fact in `edge.facts.host` makes and reads it).
CLUSTER_ID_FILE = "~/.spark-reconciler/cluster-id"


@dataclass(frozen=True)
class Owner:
    """This cluster as its containers' instance label names it."""

    label: str  # what new containers are labelled with
    names: frozenset[str]  # every label value that is this cluster's
    head: str  # the head node's name, for messages
    identity: bool  # the head's cluster id was read (else: the head's SSH address stands for it)
    head_read: bool  # the head answered its probe: False means whose a container is could not be asked

    def describe(self) -> str:
        return f"cluster {self.label}" if self.identity else self.label

    def hint(self, label: str | None) -> str | None:
        """What to do about a managed container whose instance label `label` is not this cluster's: adopt it (a
        former address of this head) or move it away; or that the head could not be asked. None: nothing to add
        (no cluster id to adopt into: an older snapshot)."""
        if not self.head_read:
            return (f"whether it is this cluster's cannot be told: the cluster id on the head {self.head} could not "
                    "be read (unreachable, or its probe failed); nothing is stopped until it is")
        if not self.identity:
            return None
        if label is None or not re.fullmatch(KNOWN_AS_PATTERN, label):  # a line the head's probe would refuse
            return "remove or rename that container"
        return (f"if that is this head under a former address, add the line `{label}` to {CLUSTER_ID_FILE} on "
                f"{self.head} and it is adopted; otherwise remove or rename that container")

    def foreign(self, label: str | None) -> str:
        """What the serving drift says of a managed container under the serving name that is not this cluster's."""
        whose = "a reconciler's" if not self.head_read else "another reconciler's"
        hint = self.hint(label)
        return f"{whose} container (instance {label}) holds the name" + (f": {hint}" if hint else "")


def owner(desired: Desired, observed: Observed) -> Owner:
    """This cluster's owner: the head's cluster id and its former names when the head's probe read them, else the
    head's SSH address (`Desired.instance`), which is what an older snapshot plans with, and what a step's context
    without an observation of the head (none was made) names."""
    head = observed.nodes.get(desired.head.name)  # None: not observed, so not read (as unreachable)
    read = head is not None and head.probed
    identity = head.identity if head is not None else None
    if identity is None:
        return Owner(desired.instance, frozenset({desired.instance}), desired.head.name, False, read)
    return Owner(identity.id, frozenset({identity.id, *identity.known_as}), desired.head.name, True, read)
