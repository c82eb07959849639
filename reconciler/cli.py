"""The `reconciler` command. Names and exit codes are a contract (docs/cli.md); keep them stable.

Exit codes, the same in every command (reconciler.core.exits): 0 nothing to do / converged / valid, 1 an error of
any kind, 2 changes pending or differences (plan, apply --dry-run, verify, status: like terraform
-detailed-exitcode), 3 the file or its secrets invalid, 4 held by another actor, 5 a node (status: the daemon)
unreachable.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource
from pydantic import ValidationError

from reconciler.core import planning, spec
from reconciler.core.exits import Exit
from reconciler.core.export import lws_yaml
from reconciler.core.observed import Observed
from reconciler.core.render import plan_text
from reconciler.core.text import printable

if TYPE_CHECKING:
    from ruamel.yaml.comments import CommentedMap

    from reconciler.core.recipes import Recipe
    from reconciler.edge.discover.guess import NodeDraft
    from reconciler.edge.discover.render import SshChoice
    from reconciler.edge.trusted_files import Secrets

#: The shipped unit's `EnvironmentFile=` (reconciler/files/systemd/reconciler.service): where every command reads
#: the values of serving.secrets by default, so the CLI and the daemon see the same ones.
ENVIRONMENT_FILE = "/etc/spark-reconciler/environment"


class _Commands(click.Group):
    """click exits 2 on a bad option, which a script reading Terraform's codes takes for "changes pending":
    every click error exits 1 here, as Terraform's do; what a command exits with itself passes through."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False  # exceptions come here, and the codes below are ours
        try:
            return super().main(*args, **kwargs)
        except click.ClickException as exc:
            exc.show()
            sys.exit(Exit.ERROR)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(Exit.ERROR)


def _env_file_option(command: Callable[..., None]) -> Callable[..., None]:
    """`--env-file`: where the values of serving.secrets come from, for every command that reads them: systemd's
    file for the daemon (EnvironmentFile=), read as systemd reads it, over this process's environment."""
    return click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path), default=ENVIRONMENT_FILE,
                        show_default=True, envvar="RECONCILER_ENV_FILE",
                        help="The values of serving.secrets (the unit's EnvironmentFile=; they win over this "
                             "shell's). The default may be absent; a file named here must exist.")(command)


def _env_file_named() -> bool:
    """--env-file (or RECONCILER_ENV_FILE) given: then the file must exist; the default may be absent."""
    return click.get_current_context().get_parameter_source("env_file") != ParameterSource.DEFAULT


def _secrets(env_file: Path) -> Secrets:
    from reconciler.edge import trusted_files

    try:
        return trusted_files.secrets_environment(env_file, _env_file_named(), os.environ)
    except trusted_files.EnvironmentFileError as exc:
        click.echo(printable(str(exc)), err=True)
        sys.exit(Exit.INVALID)


def _load_or_exit(path: str, env_file: Path | None = None, uid: int | None = None) -> spec.Desired:
    """The desired state, or exit 3 with every problem placed. With `env_file` (the commands that connect, and
    validate): the secrets must all be there (`--env-file`, then this process's environment), and every trusted
    file must be changeable by root or this user (`uid`: validate's daemon user) only
    (reconciler.edge.trusted_files): what the daemon demands."""
    from reconciler.edge import log, trusted_files

    desired, problems = trusted_files.load(path, None if env_file is None else _secrets(env_file), uid)
    for line in problems:
        click.echo(printable(line), err=True)
    if desired is None:
        sys.exit(Exit.INVALID)
    for value in desired.secret_values():
        log.register_secret(value)
    return desired


def _nodes_options(command: Callable[..., None]) -> Callable[..., None]:
    """The options that name the nodes and how they are reached, as `discover` and `init` both take them."""
    for option in reversed((
            click.option("--worker", "workers", multiple=True, help="A worker's SSH address (repeat for each "
                                                                    "worker)."),
            click.option("--user", default="spark", show_default=True, help="SSH user on every node."),
            click.option("--known-hosts", default="/etc/spark-reconciler/known_hosts", show_default=True,
                         help="known_hosts every host key is checked against (strict; nothing is trusted on first "
                              "use)."),
            click.option("--identity", default=None, help="Private key file (default: the SSH agent / ~/.ssh "
                                                          "keys)."),
            click.option("--jump-through-head/--no-jump", default=True, show_default=True,
                         help="Reach the workers through the head (like ssh -J), as an internet-less worker is."))):
        command = option(command)
    return command


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """`reconciler --version`: `reconciler, version 0.1.0 (git 6a88048)` (click's words, which scripts already
    match, and the revision as reconciler._revision finds it)."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    from reconciler._revision import revision

    try:
        number = version("spark-reconciler")
    except PackageNotFoundError:
        number = "unknown"
    click.echo(f"reconciler, version {number} (git {revision()})")
    ctx.exit()


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version and the git revision it was built from, and exit.")
def main() -> None:
    """Keep a multi-node vLLM deployment on DGX Sparks exactly as declared in a desired-state file."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@_env_file_option
@click.option("--skip-secrets", is_flag=True,
              help="Judge the file alone: not its secrets nor the modes of the files it trusts (a file checked "
                   "away from the head, in CI).")
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def validate(file: str, env_file: Path, skip_secrets: bool, daemon_user: str | None) -> None:
    """Check FILE as the daemon would take it: the file (every error as FILE:LINE:COL: field.path: message),
    every secret it names (--env-file, then the environment; never a value shown) and the modes of the files it
    trusts, as the daemon's user sees them. Exit 0 valid, 3 not: `validate && systemctl reload` never feeds the
    daemon what it would refuse."""
    from reconciler.edge.trusted_files import daemon_user as resolve

    try:
        _user, uid = resolve(daemon_user)
    except KeyError:
        click.echo(printable(f"validate: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    _load_or_exit(file, None if skip_secrets else env_file, uid)
    click.echo(f"{file}: valid")


@main.command()
@click.option("--markdown", is_flag=True, help="The reference in docs/desired-state.md instead of JSON Schema.")
def schema(markdown: bool) -> None:
    """Print the JSON Schema of the desired state (for editors)."""
    if markdown:
        from reconciler.core.docgen import markdown as render

        click.echo(render(), nl=False)
        return
    click.echo(json.dumps(spec.json_schema(), indent=2))


@main.command(name="print")
@click.argument("name", required=False)
def print_file(name: str | None) -> None:
    """Print a shipped file (systemd unit, alert rules, dashboard, sample, ...) to stdout, e.g.
    `reconciler print unit | sudo tee /etc/systemd/system/spark-reconciler.service`. Without NAME: the names."""
    from reconciler import files

    if name is None:
        for key, (_path, what) in files.SHIPPED.items():
            click.echo(f"{key:<20} {what}")
        return
    if name not in files.SHIPPED:
        click.echo(printable(f"print: no file named {name!r}; one of: {', '.join(files.SHIPPED)}"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(files.read(name), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--observed", "snapshot", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Plan offline from a saved `observe --json` snapshot.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli.md).")
@_env_file_option
def plan(file: str, snapshot: Path | None, as_json: bool, env_file: Path) -> None:
    """Show what changes (field by field) and the ordered steps; change nothing. Exit 0 no changes, 2 changes
    pending, 1 error, 3 invalid file or secrets, 5 a node unreachable (the plan is shown, but it cannot be whole)."""
    desired = _load_or_exit(file, env_file)
    if snapshot is None:
        observed = _observe(desired)
    else:
        try:
            observed = Observed.model_validate_json(snapshot.read_bytes()).by_deployment(
                {v.deployment.name: {n.name: v.weights_root(n.name) for n in v.nodes
                                     if isinstance(v.model.path, str) or n.name in v.model.path}
                 for v in desired.views()})
        except ValidationError as exc:
            click.echo(f"{snapshot}: not an observed-state snapshot: {exc.error_count()} errors, first: "
                       f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
            sys.exit(Exit.INVALID)
    result = planning.plan(desired, observed)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(plan_text(result), nl=False)
    sys.exit(Exit.UNREACHABLE if observed.partial else Exit.CHANGES if result.changes else Exit.OK)


def _observe(desired: spec.Desired) -> Observed:
    from reconciler.edge.observe import observe as probe
    from reconciler.edge.ssh import Sessions

    sessions = Sessions(desired)
    try:
        observed, _ = probe(desired, sessions, timeout=desired.policy.timeouts.command)
    finally:
        sessions.close()
    return observed


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--node", "only", default=None,
              help="Verify this node only (default: every serving node but the source).")
@click.option("--repair", is_flag=True, help="Remove differing files so the next reconcile re-syncs exactly them.")
@click.option("--json", "as_json", is_flag=True, help="The per-node results (docs/cli.md).")
@click.option("--url", default=None, envvar="RECONCILER_URL",
              help="The running daemon's listener.  [default: http://POLICY.LISTEN of FILE]")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, envvar="RECONCILER_STATE_DIR",
              help="The daemon's state directory: its status key authenticates the request.")
@click.option("--wait", type=click.FloatRange(min=0), default=6 * 3600, show_default=True,
              help="Seconds to wait for the daemon's result.")
@_env_file_option
def verify(file: str, only: str | None, repair: bool, as_json: bool, url: str | None, state_dir: Path, wait: float,
           env_file: Path) -> None:
    """Full weight verification: sha256 of every file on the targets against the source (cached by size and
    mtime on the source). Catches what size checks cannot, such as flipped bytes. With the daemon running, the
    daemon runs it beside its loop, under its lease (only its user and root may ask: its status key); else it runs
    here. Exit 0 all match, 1 an error, 2 files differ (removed with --repair: the daemon copies them again), 3
    invalid, 4 held by another actor, 5 a node or the daemon unreachable."""
    from reconciler.edge import daemon_client as client
    from reconciler.edge.verify import targets

    desired = _load_or_exit(file)  # the daemon has the secrets: here only policy.listen is read
    if len(desired.deployments) > 1:
        click.echo("verify: a verify compares one model's copies with its source: a file of several deployments "
                   "is not verified yet", err=True)
        sys.exit(Exit.ERROR)
    if only is not None and only not in targets(desired):
        click.echo(printable(f"verify: --node {only} is not a node to verify: the serving nodes but the source "
                             f"({desired.source_node}) are: {', '.join(targets(desired)) or 'none'}"), err=True)
        sys.exit(Exit.ERROR)

    def say(line: str) -> None:
        click.echo(printable(line), err=True)

    try:
        results = client.verify_by_daemon(url or f"http://{desired.policy.listen}", state_dir, file, repair=repair,
                                          only=only, wait=wait, say=say)
    except (client.NoDaemon, client.Declined) as exc:
        say(f"verifying here: {exc}")
        results = _verify_here(file, only, repair, env_file)
    except client.Failed as exc:
        say(exc.message)
        sys.exit(exc.code)
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        for r in results:
            click.echo(printable(str(r.get("message"))))
    sys.exit(client.exit_code(results))


def _verify_here(file: str, only: str | None, repair: bool, env_file: Path) -> list[dict[str, Any]]:
    """`verify` without a daemon: this command's own SSH sessions, the cluster's lease to repair (exit 4 when
    another actor holds it), the secrets from --env-file."""
    from reconciler.edge.lease import Holder, LeaseHeld, LeaseUnreachable
    from reconciler.edge.verify import verify_here

    desired = _load_or_exit(file, env_file)
    try:
        return verify_here(desired, Holder.of("verify-repair", file), only, repair)
    except LeaseUnreachable as exc:
        click.echo(printable(f"Nothing repaired: {exc}."), err=True)
        sys.exit(Exit.UNREACHABLE)
    except LeaseHeld as exc:
        click.echo(printable(f"Nothing repaired: {exc}."), err=True)
        sys.exit(Exit.HELD)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
def sudoers(file: str) -> None:
    """Print the exact sudoers lines every node needs for FILE (per interface, nothing wider)."""
    from reconciler.edge.ssh import sudoers_snippet

    click.echo(sudoers_snippet(_load_or_exit(file)), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="The snapshot `plan --observed` reads.")
@_env_file_option
def observe(file: str, as_json: bool, env_file: Path) -> None:
    """Probe every node once (one batched script each) and print what is there. Exit 5 if a node is unreachable."""
    desired = _load_or_exit(file, env_file)
    observed = _observe(desired)
    if as_json:
        click.echo(observed.model_dump_json(indent=1))
    else:
        from reconciler.core.render import observed_text

        click.echo(observed_text(observed), nl=False)
    sys.exit(Exit.UNREACHABLE if observed.partial else Exit.OK)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing anything.")
@click.option("--dry-run", is_flag=True, help="Show the plan and stop (exit 2 if it has changes, as plan).")
@click.option("--max-passes", default=3, show_default=True, help="Observe-plan-execute rounds before giving up.")
@_env_file_option
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, envvar="RECONCILER_LOG_LEVEL",
              help="The least severe level logged. Under systemd every line carries its syslog priority "
                   "(journalctl -p warning).")
def apply(file: str, yes: bool, dry_run: bool, max_passes: int, env_file: Path, log_level: str) -> None:
    """One convergence pass: observe, show the plan, execute it in order, verify. Exit 0 converged, 1 not (or an
    error), 3 invalid file or secrets, 4 held by another actor, 5 a node unreachable."""
    from reconciler.edge import log
    from reconciler.edge.lease import Holder
    from reconciler.loop.apply import apply_once

    desired = _load_or_exit(file, env_file)
    log.configure(level=log_level)
    sys.exit(apply_once(desired, yes=yes, dry_run=dry_run, max_passes=max_passes,
                        holder=Holder.of("apply", file)))


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, envvar="RECONCILER_STATE_DIR", help="Lock, generation counter.")
@click.option("--listen", default=None, help="HOST:PORT for /metrics and /status (default: policy.listen).")
@click.option("--no-events", is_flag=True, help="Resync only: no docker/link event streams.")
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default="auto", show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, envvar="RECONCILER_LOG_LEVEL",
              help="The least severe level logged. Under systemd every line carries its syslog priority "
                   "(journalctl -p warning).")
@_env_file_option
def run(file: Path, state_dir: Path, listen: str | None, no_events: bool, log_format: str, log_level: str,
        env_file: Path) -> None:
    """The daemon: keep the cluster converged until SIGTERM (systemd: Type=notify). The secrets are read from
    --env-file at every load, so a rotated key is an edit of that file and a reload (SIGHUP)."""
    from reconciler.edge import log, trusted_files
    from reconciler.loop.daemon import AlreadyRunning, Daemon

    explicit = _env_file_named()
    log.configure(json_lines=None if log_format == "auto" else log_format == "json", level=log_level)
    daemon = Daemon(file, state_dir, listen=listen, events=not no_events,
                    secrets=lambda: trusted_files.secrets_environment(env_file, explicit, os.environ))
    daemon.install_signals()
    try:
        code = daemon.run()
        # Exit now: a worker thread stuck in a TCP connect to a dead node must not hold the interpreter's
        # shutdown past systemd's TimeoutStopSec (everything that matters was closed or flushed above).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except AlreadyRunning as exc:
        click.echo(f"reconciler run: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"reconciler run: {exc}", err=True)
        sys.exit(1)


_STATE_DIR = click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                          default="/var/lib/spark-reconciler", show_default=True, envvar="RECONCILER_STATE_DIR",
                          help="The daemon's state directory (where it keeps the history).")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_STATE_DIR
@click.option("--json", "as_json", is_flag=True, help="The entries and the rollback hold as JSON.")
def history(file: Path, state_dir: Path, as_json: bool) -> None:
    """The generations of FILE the daemon kept: when each was taken, when it first served, how it ended (docs/
    operations.md "History and rollback"). Exit 1 when none is kept."""
    from reconciler.loop import history as kept

    try:
        found = kept.read(state_dir, file, daemon=False)
    except (OSError, ValueError) as exc:
        click.echo(printable(f"reconciler history: cannot read the history in {state_dir}: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(found.to_json() if as_json else found.table())
    sys.exit(Exit.OK if found.entries else Exit.ERROR)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.argument("generation", type=click.IntRange(min=1), required=False)
@_STATE_DIR
@_env_file_option
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def rollback(file: Path, generation: int | None, state_dir: Path, env_file: Path, daemon_user: str | None) -> None:
    """Write a kept generation's text back over FILE (default: the one the daemon rolled back to, else the newest
    that served before the newest), atomically, after a copy of what FILE held: the file stays the truth, and the
    daemon takes it as a new generation. The text is validated first (as `validate` does); nothing is written
    when it is not valid today."""
    import time

    from reconciler.edge import trusted_files
    from reconciler.loop import history as kept

    try:
        _user, uid = trusted_files.daemon_user(daemon_user)
    except KeyError:
        click.echo(printable(f"reconciler rollback: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    try:
        entry = kept.rollback_target(kept.read(state_dir, file, daemon=False), generation)
    except (OSError, ValueError) as exc:
        click.echo(printable(f"reconciler rollback: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    text = kept.text_of(state_dir, file, entry.generation)
    if text is None:
        click.echo(f"reconciler rollback: the text of generation {entry.generation} is not kept in "
                   f"{kept.directory(state_dir, file)}", err=True)
        sys.exit(Exit.ERROR)
    kept_at = kept.directory(state_dir, file) / f"{entry.generation}.yaml"
    _, problems = trusted_files.load_text(text, file, _secrets(env_file), kept_at, uid)
    if problems:
        click.echo(f"reconciler rollback: generation {entry.generation} is not valid today; nothing written:\n"
                   + "\n".join(problems), err=True)
        sys.exit(Exit.INVALID)
    try:
        copy = kept.write_back(file, text, time.time())
    except OSError as exc:
        click.echo(printable(f"reconciler rollback: cannot write {file}: {exc}; nothing changed"), err=True)
        sys.exit(Exit.ERROR)
    click.echo(f"{file}: generation {entry.generation} written back (what it held is in {copy}); the daemon takes "
               "it as a new generation")


@main.command()
@click.option("--url", default="http://127.0.0.1:9464", show_default=True, envvar="RECONCILER_URL",
              help="The daemon's listener (policy.listen).")
@click.option("--json", "as_json", is_flag=True,
              help="The raw /status document (with --watch: one document per line, each time it is asked).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, help="The daemon's state directory: its status key proves who answered.")
@click.option("--wide", is_flag=True,
              help="Every condition, each message whole under its row (like kubectl describe).")
@click.option("--watch", "-w", is_flag=True,
              help="Ask again every --interval and redraw in place until Ctrl-C (like kubectl get -w).")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Seconds between two answers under --watch.")
def status(url: str, as_json: bool, state_dir: Path, wide: bool, watch: bool, interval: float) -> None:
    """The running daemon's phase, nodes, conditions, operations in flight and blockers, at the terminal's width.
    Exit 0 converged, 2 not converged, 1 an answer not provably from the daemon that keeps --state-dir (or not a
    status document), 5 no daemon answering; under --watch, the last frame's."""
    from reconciler.edge import status_client

    sys.exit(status_client.main(url, state_dir, as_json=as_json, wide=wide, watch=watch, interval=interval))


@main.command()
@click.option("--head", "head", required=True, help="The head's SSH address (it runs rank 0 and the API).")
@_nodes_options
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the desired state here (default: stdout).")
@click.option("--port", default=22, show_default=True, help="SSH port.")
@click.option("--model", default=None, metavar="ORG/NAME",
              help="The model to serve (default: the largest in a node's Hugging Face cache). Need not be on the "
                   "head yet: `apply` downloads it there.")
@click.option("--revision", default=None, help="The model's revision, a commit hash to pin (default: the cache's "
                                                 "refs/main, else main).")
@click.option("--image", default=None, help="The serving image (default: the largest *vllm* image on the head). "
                                            "Need not be on the head yet: `apply` pulls it there.")
@click.option("--api-key-secret", is_flag=True,
              help="Declare serving.secrets VLLM_API_KEY (value from the daemon's environment, never the file).")
def discover(head: str, workers: tuple[str, ...], user: str, known_hosts: str, identity: str | None,
             jump_through_head: bool, output: Path | None, port: int, model: str | None, revision: str | None,
             image: str | None, api_key_secret: bool) -> None:
    """Read the nodes (one read-only script each) and write a commented starter desired state.

    Every inferred value is marked `# GUESS:`; what --model, --revision, --image and --api-key-secret name is
    written as given. Exit 0 when the result validates, 3 when it does not (it is written anyway, with the
    problems printed), 5 when a node cannot be reached, 1 a bad address or another error."""
    from reconciler.edge import discover as disc
    from reconciler.edge.ssh import RemoteError

    known_hosts = str(Path(known_hosts).resolve())
    identity = str(Path(identity).resolve()) if identity else None
    try:
        sessions = disc.sessions_for(head, list(workers), user=user, known_hosts=known_hosts, identity=identity,
                                     jump=jump_through_head, port=port)
    except ValidationError as exc:
        click.echo(f"discover: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
        sys.exit(Exit.ERROR)
    try:
        facts = disc.probe(sessions)
    except RemoteError as exc:
        click.echo(printable(f"discover: {exc}"), err=True)
        sys.exit(Exit.UNREACHABLE)
    finally:
        for s in reversed(sessions):
            s.close()
    text = disc.render(facts, user=user, known_hosts=known_hosts, identity=identity, jump=jump_through_head,
                       asked=disc.ModelChoice(model, revision, image, api_key_secret))
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        click.echo(f"wrote {output} ({text.count('# GUESS:')} guesses to review)", err=True)
    try:
        spec.loads(text, filename=str(output or "<discovered>"))
    except spec.InvalidDesiredState as exc:
        for line in exc.lines():
            click.echo(line, err=True)
        sys.exit(Exit.INVALID)


# ---------------------------------------------------------------------------------------------- init

#: The RDMA device of a Spark's outer QSFP port's first half (ibdev2netdev: rocep1s0f1 ==> enp1s0f1np1), which
#: discover's fallback interface `enp1s0f1np1` belongs to.
SPARK_RDMA_DEVICE = "rocep1s0f1"
INIT_HEADER = ("Desired state written by `reconciler init` from recipes (docs/recipes.md); no node was read.\n"
               "Review every `# GUESS:` line (`reconciler discover` reads the nodes' real ports and addresses),\n"
               "then: reconciler validate FILE && reconciler plan FILE.\n"
               "Keep the end marker `...` the last line: a half-written save is then refused.")
_UNREAD_FABRIC = ("init reads no node: the Spark's outer QSFP port assumed (NVIDIA's connect-two-sparks; its twin "
                  "enP2p1s0f1np1 may be declared too, in another subnet)")


def _hostname(host: str) -> str:
    """The name a node is drafted under: the host given when it is a name, none for an address (discover then
    names the nodes head, worker1, ...)."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return ""


def _unread_node(draft: NodeDraft, is_head: bool, head_name: str, choice: SshChoice) -> CommentedMap:
    """discover's entry of a node (its ssh and fabric sections), for a node init has not read: the Spark's
    defaults in place of what discover reads, each said to be a guess."""
    from dataclasses import replace

    from ruamel.yaml.comments import CommentedMap

    from reconciler.edge.discover.render import _above, _eol, _fabric, _ssh, quoted

    spark = replace(draft, fabric=replace(draft.fabric, rdma_device=SPARK_RDMA_DEVICE, notes=[_UNREAD_FABRIC]))
    entry = CommentedMap([("name", quoted(draft.name)), ("role", "head" if is_head else "worker")])
    _eol(entry, "name", "as --head/--worker name it" if draft.facts.hostname else "GUESS: given as an address: "
                        "rename it freely")
    entry["ssh"] = _ssh(draft, is_head, head_name, choice)
    entry["fabric"], notes = _fabric(spark)
    _above(entry, "fabric", notes, indent=4)
    _eol(entry["fabric"], "rdma_device", "GUESS: that port's RDMA device on a Spark")
    _eol(entry["fabric"], "address", "GUESS: NVIDIA's netplan example subnet; yours may differ")
    _eol(entry["fabric"], "mtu", "the Spark recipes' value (set by the link step)")
    entry["internet"] = is_head
    _eol(entry, "internet", "GUESS: the head downloads the weights and pulls the image" if is_head else
         "GUESS: internet-less, as the seed's worker: weights and image come from the head")
    entry["gpus"] = 1
    _eol(entry, "gpus", "GUESS: a DGX Spark has one GB10")
    return entry


def _unread_nodes(hosts: list[str], choice: SshChoice) -> tuple[list[NodeDraft], list[CommentedMap]]:
    """The nodes as discover drafts them (names, fabric ports and addresses in one subnet), from the addresses
    alone: the head first."""
    from reconciler.edge.discover.facts import NodeFacts
    from reconciler.edge.discover.guess import draft_nodes

    drafts = draft_nodes([NodeFacts(host=host, hostname=_hostname(host)) for host in hosts])
    return drafts, [_unread_node(d, i == 0, drafts[0].name, choice) for i, d in enumerate(drafts)]


def _commented(value: Any) -> Any:
    """A composed deployment as YAML nodes of its own: every string double-quoted (a flag such as `on` or `no`
    stays a string for any YAML reader), lists of values on one line."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    from reconciler.edge.discover.render import _flow, quoted

    if isinstance(value, dict):
        return CommentedMap((key, _commented(item)) for key, item in value.items())
    if isinstance(value, list):
        return _flow(CommentedSeq(_commented(item) for item in value))
    return quoted(value) if isinstance(value, str) else value


def _init_text(document: dict[str, Any], used: list[Recipe], drafts: list[NodeDraft]) -> str:
    """The file: the drafted nodes, each deployment under a comment naming its recipe (whose header says where
    every value comes from), discover's co-tenants and policy sections."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    from reconciler.core.recipes import FIRST_API_PORT
    from reconciler.edge.discover.render import _above, _co_tenants, _dump, _policy

    out = CommentedMap()
    out.yaml_set_start_comment(INIT_HEADER)
    out["nodes"] = CommentedSeq(document["nodes"])
    out["deployments"] = deployments = CommentedSeq(_commented(d) for d in document["deployments"])
    for i, recipe in enumerate(used):
        about = [f"recipe {recipe.name}: {recipe.description}",
                 f"its sources and why each value: the header of recipes/{recipe.name}.yaml (reconciler/files/recipes)",
                 *_init_cautions(recipe)]
        deployments.yaml_set_comment_before_after_key(i, before="\n".join(["", *about] if i else about), indent=2)
    out["co_tenants"] = _co_tenants(drafts, FIRST_API_PORT)
    out["policy"] = _policy()
    for section in ("deployments", "co_tenants", "policy"):
        _above(out, section, [], indent=0, blank=True)
    return "\n".join(map(printable, _dump(out).split("\n")))


def _init_cautions(recipe: Recipe) -> list[str]:
    """What to know before serving `recipe` on the image it names: that no record shows it serving there (its
    header's `unverified:`), and what it needs that the image is not known to provide (`Recipe.lacks`)."""
    out = [f"UNVERIFIED: {recipe.unverified}"] if recipe.unverified else []
    if recipe.image_known() is None:
        out.append(f"IMAGE UNKNOWN TO INIT: {recipe.serving.get('image')} is not one whose Ray and vLLM init knows; "
                   "`reconciler plan` asks it before anything starts")
    return out + [f"NEEDS WHAT ITS IMAGE LACKS: {lack}" for lack in recipe.lacks()]


def _init_warnings(used: list[Recipe]) -> None:
    """Each picked recipe's cautions on stderr, once per recipe: they do not stop the file (its fields are valid;
    `plan` judges the image itself before anything starts), but an operator should not learn them from a failed
    start."""
    for recipe in {r.name: r for r in used}.values():
        for caution in _init_cautions(recipe):
            click.echo(printable(f"init: warning: recipe {recipe.name}: {caution}"), err=True)


def _refused(exc: spec.InvalidDesiredState) -> None:
    """Why the composition is not a valid file, then exit 3: nothing is written."""
    for problem in exc.problems:
        click.echo(printable(f"init: {problem.path}: {problem.message}"), err=True)
    click.echo("init: nothing written", err=True)
    sys.exit(Exit.INVALID)


def write_output(output: Path, text: str) -> None:
    """`init -o` and `discover -o`: written as the state dir's files are (`generations.write_durably`: a new
    temporary file of an unforeseeable name beside PATH, renamed over it), so a link planted at PATH or at a
    temporary name is never written through (issue 53, finding F: once `Path.write_text`, which follows one).
    A regular file already at PATH keeps its mode (and, as root, its owner); a new one gets the umask's."""
    import stat

    from reconciler.loop.generations import write_durably

    try:
        was = os.lstat(output)
    except FileNotFoundError:
        was = None
    umask = os.umask(0o077)
    os.umask(umask)
    write_durably(output, text, like=was if was is not None and stat.S_ISREG(was.st_mode) else None,
                  mode=0o666 & ~umask)


@main.command()
@click.option("--recipe", "picks", multiple=True, metavar="NAME[@NODE]",
              help="A recipe to serve, one deployment each (repeat; `--list` names them). @NODE runs a single-node "
                   "recipe on that node (its name, or `head`, or `worker` when there is one); by default a recipe "
                   "takes whole nodes from the head on, as many as its tensor parallel size.")
@click.option("--list", "list_only", is_flag=True, help="List the recipes, one line each (also without --recipe).")
@click.option("--head", default=None, help="The head's SSH address (it runs rank 0 and the API).")
@_nodes_options
@click.option("--models-path", default=None,
              help="The Hugging Face hub directory of every node, where the models are.  "
                   "[default: /home/USER/.cache/huggingface/hub]")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the desired state here (default: stdout).")
def init(picks: tuple[str, ...], list_only: bool, head: str | None, workers: tuple[str, ...], user: str,
         known_hosts: str, identity: str | None, jump_through_head: bool, models_path: str | None,
         output: Path | None) -> None:
    """Write a desired state that serves recipes (docs/recipes.md): the nodes drafted as discover drafts them,
    but from their addresses alone (every guess marked `# GUESS:`), one deployment per --recipe, each with its own
    container name and ports. The file is judged as `validate` judges it before anything is written. A recipe
    no record shows serving on its image (`unverified:`), or that needs what its image is not known to provide
    (Ray, a vLLM fix), is said on stderr and in the file, and written all the same. Exit 0 written, 3 not a valid
    file (e.g. a node's memory fractions add up past 1; nothing written), 1 an unknown recipe, a recipe that
    cannot be placed or a missing --head."""
    from reconciler import files
    from reconciler.core import recipes
    from reconciler.edge.discover.render import SshChoice

    known = recipes.catalogue(files.recipes())
    if list_only or not picks:
        for recipe in known.values():
            click.echo(recipe.summary())
        return
    if head is None:
        click.echo("init: --head is required with --recipe (the head's SSH address)", err=True)
        sys.exit(Exit.ERROR)
    choice = SshChoice(user, str(Path(known_hosts).resolve()), str(Path(identity).resolve()) if identity else None,
                       jump_through_head)
    drafts, nodes = _unread_nodes([head, *workers], choice)
    chosen = [recipes.Pick.of(p) for p in picks]
    try:
        document = recipes.compose(known, chosen, nodes, models_path or f"/home/{user}/.cache/huggingface/hub")
    except recipes.RecipeError as exc:
        click.echo(printable(f"init: {exc}"), err=True)
        sys.exit(Exit.ERROR)
    used = [known[p.recipe] for p in chosen]
    text = _init_text(document, used, drafts)
    try:
        spec.loads(text, filename=str(output or "<init>"))
    except spec.InvalidDesiredState as exc:
        _refused(exc)
    _init_warnings(used)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        click.echo(f"wrote {output}: {len(chosen)} deployments, {text.count('# GUESS:')} guesses to review", err=True)


#: `export --format`: each format and its renderer. The option's choices are this table's keys, so a format is
#: never offered without the renderer that reads it (the option was once accepted and ignored).
EXPORT_FORMATS: dict[str, Callable[[spec.Desired, str | None], str]] = {"lws": lws_yaml}


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--format", "fmt", type=click.Choice(sorted(EXPORT_FORMATS)), default="lws", show_default=True,
              help="lws: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) for Kubernetes.")
@click.option("--name", default=None, help="metadata.name (default: the served model name, DNS-safe).")
def export(file: str, fmt: str, name: str | None) -> None:
    """Print the equivalent Kubernetes manifest of FILE's serving (the bridge to LWS; see docs/scaling.md)."""
    desired = _load_or_exit(file)
    click.echo(EXPORT_FORMATS[fmt](desired, name), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable checks (docs/cli.md).")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path),
              default=ENVIRONMENT_FILE, show_default=True,
              help="The environment file systemd gives the daemon (EnvironmentFile=): serving.secrets' names.")
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def doctor(file: str, as_json: bool, env_file: Path, daemon_user: str | None) -> None:
    """Check every node's prerequisites over the daemon's own SSH (kubeadm preflight): each check ok, warn or
    fail with what it saw and the exact fix. Changes nothing. Exit 0 all ok or warn, 1 a check failed, 3 invalid."""
    from reconciler.core.preflight import exit_code, report_json, report_text
    from reconciler.edge.doctor import doctor as run_checks

    desired = _load_or_exit(file)  # secrets come from --env-file, and loose file modes are checks, not refusals
    try:
        found = run_checks(desired, file, env_file, daemon_user)
    except KeyError:
        click.echo(printable(f"doctor: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(Exit.ERROR)
    if as_json:
        click.echo(json.dumps(report_json(found), indent=2))
    else:
        click.echo(report_text(found), nl=False)
    sys.exit(exit_code(found))
