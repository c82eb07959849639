"""The desired state: what the operator declares, validated at the border before anything reaches a node.

Split by the question a reader comes with, each file answering one; the imports run one way only:
`placing` -> `models` -> `rules` -> `values` (the rules are given the models, and name them only for the type
checker, so `Desired`'s validator can run them without an import cycle).

- `values.py`: is this one value acceptable? The strict patterns every string that can reach a remote command is
  held to, durations (`30s`), sizes (`4GiB`), what serving.env and serving.extra_args may not set, the system
  paths no file may name.
- `models.py`: what does the file declare? The frozen pydantic models, their defaults and descriptions (the
  reference docs/desired-state.md is generated from them) and the views derived from them (`Desired.head`, ...).
- `rules.py`: do the fields agree? The cross-field rules (`consistency_problems`: one head, no jump-host cycles,
  tp x pp against the GPUs, what `trust` must allow, ...), each problem with the field path it concerns.
- `placing.py`: where is the problem? A file read into a `Desired` (`load`, `loads`), or every problem placed at
  FILE:LINE:COL with a message an operator can act on.

Other modules import this package, not its files: the names below are everything they use.
"""

from reconciler.core.spec.models import (
    SINGLE,
    CoTenants,
    Deployment,
    Desired,
    DockerOptions,
    Fabric,
    FabricPort,
    Model,
    Node,
    Policy,
    Retention,
    Retries,
    Serving,
    SeveralDeployments,
    Ssh,
    Timeouts,
    WeightsPolicy,
    json_schema,
)
from reconciler.core.spec.placing import ENVIRONMENT, InvalidDesiredState, load, loads
from reconciler.core.spec.rules import KEY, ConsistencyError, MissingSecrets, consistency_problems
from reconciler.core.spec.values import (
    RESERVED_ENV,
    AbsPath,
    ContainerName,
    ContainerPattern,
    DeploymentName,
    EnvName,
    EnvValue,
    ExtraArg,
    HostName,
    ImageRef,
    InterfaceName,
    ModelId,
    NodeName,
    RdmaDevice,
    Revision,
    ServedName,
    SshUser,
    format_duration,
    mount_refusal,
    parse_duration,
    parse_size,
)

__all__ = [
    "KEY",
    "RESERVED_ENV",
    "AbsPath",
    "ConsistencyError",
    "ContainerName",
    "ContainerPattern",
    "DeploymentName",
    "CoTenants",
    "Deployment",
    "SINGLE",
    "SeveralDeployments",
    "Desired",
    "DockerOptions",
    "EnvName",
    "EnvValue",
    "ExtraArg",
    "Fabric",
    "FabricPort",
    "HostName",
    "ImageRef",
    "InterfaceName",
    "ENVIRONMENT",
    "InvalidDesiredState",
    "MissingSecrets",
    "Model",
    "ModelId",
    "Node",
    "NodeName",
    "Policy",
    "RdmaDevice",
    "Retries",
    "Revision",
    "ServedName",
    "Serving",
    "Ssh",
    "SshUser",
    "Timeouts",
    "Retention",
    "WeightsPolicy",
    "consistency_problems",
    "format_duration",
    "json_schema",
    "load",
    "loads",
    "mount_refusal",
    "parse_duration",
    "parse_size",
]
