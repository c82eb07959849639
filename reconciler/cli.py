"""The `reconciler` command. Names and exit codes are a contract (docs/cli.md); keep them stable.

validate 0 valid / 2 invalid; plan 0 no changes / 1 changes pending / 2 invalid (like terraform -detailed-exitcode);
apply 0 converged / 1 not / 2 invalid; observe 0 / 3 a node unreachable; status 0 converged / 1 not.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click
from pydantic import ValidationError

from reconciler.core import planning, spec
from reconciler.core.observed import Observed
from reconciler.core.render import plan_text
from reconciler.core.text import printable

EXIT_INVALID = 2


def _load_or_exit(path: str, connects: bool = False) -> spec.Desired:
    """The desired state, or exit 2 with every problem placed. `connects`: for the commands that connect to the
    nodes: take serving.secrets from this process's environment (the spec hash covers the values), and refuse
    files that someone other than root or this user may change (reconciler.edge.trusted_files)."""
    from reconciler.edge import log, trusted_files

    try:
        desired = spec.load(path, os.environ if connects else None)
        unsafe = trusted_files.problems(trusted_files.trusted_paths(desired, path)) if connects else []
    except spec.InvalidDesiredState as exc:
        unsafe = exc.lines()
    for line in unsafe:
        click.echo(printable(line), err=True)
    if unsafe:
        sys.exit(EXIT_INVALID)
    for value in desired.secret_values():
        log.register_secret(value)
    return desired


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version and the git revision it was built from, and exit.")
def main() -> None:
    """Keep a multi-node vLLM deployment on DGX Sparks exactly as declared in a desired-state file."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
def validate(file: str) -> None:
    """Parse and validate FILE; print every error as FILE:LINE:COL: field.path: message."""
    _load_or_exit(file)
    click.echo(f"{file}: valid")


@main.command()
@click.option("--markdown", is_flag=True, help="The reference in docs/desired-state.md instead of JSON Schema.")
def schema(markdown: bool) -> None:
    """Print the JSON Schema of the desired state (for editors)."""
    if markdown:
        from reconciler.core.docgen import markdown as render

        click.echo(render(), nl=False)
        return
    click.echo(json.dumps(spec.Desired.model_json_schema(mode="validation"), indent=2))


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
        sys.exit(EXIT_INVALID)
    click.echo(files.read(name), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--observed", "snapshot", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Plan offline from a saved `observe --json` snapshot.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli.md).")
def plan(file: str, snapshot: Path | None, as_json: bool) -> None:
    """Show the drift and the ordered steps. Exit 0 no changes, 1 changes pending, 2 invalid."""
    desired = _load_or_exit(file, connects=True)
    if snapshot is None:
        observed = _observe(desired)
    else:
        try:
            observed = Observed.model_validate_json(snapshot.read_bytes())
        except ValidationError as exc:
            click.echo(f"{snapshot}: not an observed-state snapshot: {exc.error_count()} errors, first: "
                       f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
            sys.exit(EXIT_INVALID)
    result = planning.plan(desired, observed)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(plan_text(result), nl=False)
    sys.exit(1 if result.changes else 0)


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
@click.option("--json", "as_json", is_flag=True)
def verify(file: str, only: str | None, repair: bool, as_json: bool) -> None:
    """Full weight verification: sha256 of every file on the targets against the source (cached by size and
    mtime on the source). Catches what size checks cannot, such as flipped bytes. Exit 0 all match, 1 not."""
    from dataclasses import asdict

    from reconciler.edge.lease import Holder, LeaseHeld, held
    from reconciler.edge.ssh import Sessions
    from reconciler.edge.steps.weights import verify_weights
    from reconciler.loop.apply import EXIT_HELD

    desired = _load_or_exit(file, connects=True)
    targets = [n.name for n in desired.serving_nodes if n.name != desired.source_node and only in (None, n.name)]
    sessions = Sessions(desired)
    try:
        with contextlib.ExitStack() as stack:
            if repair:  # repairing deletes files on the nodes: one actor at a time (reconciler.edge.lease)
                stack.enter_context(held(desired, sessions, Holder.of("verify-repair", file)))
            results = [verify_weights(desired, sessions, node, repair=repair) for node in targets]
    except LeaseHeld as exc:
        click.echo(printable(f"Nothing repaired: {exc}."), err=True)
        sys.exit(EXIT_HELD)
    finally:
        sessions.close()
    if as_json:
        click.echo(json.dumps([asdict(r) for r in results], indent=2))
    else:
        for r in results:
            click.echo(printable(r.message()))
    sys.exit(0 if all(r.ok for r in results) else 1)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
def sudoers(file: str) -> None:
    """Print the exact sudoers lines every node needs for FILE (per interface, nothing wider)."""
    from reconciler.edge.ssh import sudoers_snippet

    click.echo(sudoers_snippet(_load_or_exit(file)), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="The snapshot `plan --observed` reads.")
def observe(file: str, as_json: bool) -> None:
    """Probe every node once (one batched script each) and print what is there. Exit 3 if a node is unreachable."""
    desired = _load_or_exit(file, connects=True)
    observed = _observe(desired)
    if as_json:
        click.echo(observed.model_dump_json(indent=1))
    else:
        from reconciler.core.render import observed_text

        click.echo(observed_text(observed), nl=False)
    sys.exit(3 if any(not n.reachable for n in observed.nodes.values()) else 0)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--yes", "-y", is_flag=True, help="Do not ask before changing anything.")
@click.option("--dry-run", is_flag=True, help="Show the plan and stop (exit 1 if it has steps).")
@click.option("--max-passes", default=3, show_default=True, help="Observe-plan-execute rounds before giving up.")
def apply(file: str, yes: bool, dry_run: bool, max_passes: int) -> None:
    """One convergence pass: observe, show the plan, execute it in order, verify. Exit 0 only when converged."""
    from reconciler.edge import log
    from reconciler.edge.lease import Holder
    from reconciler.loop.apply import apply_once

    desired = _load_or_exit(file, connects=True)
    log.configure()
    sys.exit(apply_once(desired, yes=yes, dry_run=dry_run, max_passes=max_passes,
                        holder=Holder.of("apply", file)))


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, envvar="RECONCILER_STATE_DIR", help="Lock, generation counter.")
@click.option("--listen", default=None, help="HOST:PORT for /metrics and /status (default: policy.listen).")
@click.option("--no-events", is_flag=True, help="Resync only: no docker/link event streams.")
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default="auto", show_default=True)
def run(file: Path, state_dir: Path, listen: str | None, no_events: bool, log_format: str) -> None:
    """The daemon: keep the cluster converged until SIGTERM (systemd: Type=notify)."""
    from reconciler.edge import log
    from reconciler.loop.daemon import AlreadyRunning, Daemon

    log.configure(json_lines=None if log_format == "auto" else log_format == "json")
    daemon = Daemon(file, state_dir, listen=listen, events=not no_events)
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


@main.command()
@click.option("--url", default="http://127.0.0.1:9464", show_default=True, envvar="RECONCILER_URL",
              help="The daemon's listener (policy.listen).")
@click.option("--json", "as_json", is_flag=True, help="The raw /status document.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default="/var/lib/spark-reconciler",
              show_default=True, help="The daemon's state directory: its status key proves who answered.")
def status(url: str, as_json: bool, state_dir: Path) -> None:
    """Ask the running daemon for its phase and conditions. Exit 0 converged, 1 not (or unreachable, or the
    answer is not provably from the daemon that keeps --state-dir)."""
    import secrets
    import urllib.error
    import urllib.request

    from reconciler.loop.server import STATUS_KEY

    challenge = secrets.token_hex(16)
    where = f"{url.rstrip('/')}/status"
    try:
        with urllib.request.urlopen(f"{where}?challenge={challenge}", timeout=5) as response:
            doc = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError, RecursionError) as exc:
        click.echo(printable(f"cannot reach the daemon at {url}: {exc}"), err=True)
        sys.exit(1)
    try:
        key: bytes | None = (state_dir / STATUS_KEY).read_bytes().strip()
    except OSError as exc:
        key = None
        click.echo(printable(f"not verified that the daemon of {state_dir} answered ({exc.strerror}: run as its "
                             "user or root)"), err=True)
    if key is not None:
        _proven_or_exit(where, doc, key, challenge, state_dir)
    text = _status_text_or_exit(where, doc)
    click.echo(json.dumps(doc, indent=2) if as_json else text)
    sys.exit(0 if doc.get("phase") == "Converged" else 1)


def _proven_or_exit(where: str, doc: object, key: bytes, challenge: str, state_dir: Path) -> None:
    """Exit 1 unless the answer carries the proof only the daemon keeping `state_dir` can make (`status_proof`):
    a local user who bound the port first (while the daemon restarted) once served a fake Converged."""
    import hmac

    from reconciler.loop.server import status_proof

    proof = doc.get("proof") if isinstance(doc, dict) else None
    if not (isinstance(proof, str) and hmac.compare_digest(proof, status_proof(key, challenge))):
        click.echo(printable(f"{where} answered without the proof of the daemon that keeps {state_dir}: another "
                             "process may hold the listener's port (run the daemon under spark-reconciler.socket, "
                             "docs/operations.md)"), err=True)
        sys.exit(1)


def _status_text_or_exit(where: str, doc: object) -> str:
    """The status as text, or exit 1 saying the answer is not a status document: whatever listens there (an
    older or newer daemon, another program on the port) may answer any JSON, and a KeyError's traceback told the
    operator nothing. The renderer is the one reader of the document's shape, so a document it cannot read is
    not one; `--json` is judged the same way before it prints."""
    from reconciler.core.render import status_text

    if not (isinstance(doc, dict) and isinstance(doc.get("phase"), str)):
        why = "no phase"
    else:
        try:
            return status_text(doc)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    click.echo(printable(f"{where} did not answer a reconciler status document ({why}); is it this cluster's "
                         "daemon (policy.listen)? docs/cli.md shows the document"), err=True)
    sys.exit(1)


@main.command()
@click.option("--head", "head", required=True, help="The head's SSH address (it runs rank 0 and the API).")
@click.option("--worker", "workers", multiple=True, help="A worker's SSH address (repeat for each worker).")
@click.option("--user", default="spark", show_default=True, help="SSH user on every node.")
@click.option("--known-hosts", default="/etc/spark-reconciler/known_hosts", show_default=True,
              help="known_hosts every host key is checked against (strict; nothing is trusted on first use).")
@click.option("--identity", default=None, help="Private key file (default: the SSH agent / ~/.ssh keys).")
@click.option("--jump-through-head/--no-jump", default=True, show_default=True,
              help="Reach the workers through the head (like ssh -J), as an internet-less worker is.")
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
    written as given. Exit 0 when the result validates, 2 when it does not (it is written anyway, with the
    problems printed), 3 when a node cannot be reached."""
    from reconciler.edge import discover as disc
    from reconciler.edge.ssh import RemoteError

    known_hosts = str(Path(known_hosts).resolve())
    identity = str(Path(identity).resolve()) if identity else None
    try:
        sessions = disc.sessions_for(head, list(workers), user=user, known_hosts=known_hosts, identity=identity,
                                     jump=jump_through_head, port=port)
    except ValidationError as exc:
        click.echo(f"discover: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", err=True)
        sys.exit(EXIT_INVALID)
    try:
        facts = disc.probe(sessions)
    except RemoteError as exc:
        click.echo(printable(f"discover: {exc}"), err=True)
        sys.exit(3)
    finally:
        for s in reversed(sessions):
            s.close()
    text = disc.render(facts, user=user, known_hosts=known_hosts, identity=identity, jump=jump_through_head,
                       asked=disc.ModelChoice(model, revision, image, api_key_secret))
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        click.echo(f"wrote {output} ({text.count('# GUESS:')} guesses to review)", err=True)
    try:
        spec.loads(text, filename=str(output or "<discovered>"))
    except spec.InvalidDesiredState as exc:
        for line in exc.lines():
            click.echo(line, err=True)
        sys.exit(EXIT_INVALID)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--format", "fmt", type=click.Choice(["lws"]), default="lws", show_default=True,
              help="lws: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) for Kubernetes.")
@click.option("--name", default=None, help="metadata.name (default: the served model name, DNS-safe).")
def export(file: str, fmt: str, name: str | None) -> None:
    """Print the equivalent Kubernetes manifest of FILE's serving (the bridge to LWS; see docs/scaling.md)."""
    from reconciler.core.export import lws_yaml

    desired = _load_or_exit(file)
    click.echo(lws_yaml(desired, name=name), nl=False)


@main.command()
@click.argument("file", type=click.Path(dir_okay=True, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable checks (docs/cli.md).")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path),
              default="/etc/spark-reconciler/environment", show_default=True,
              help="The environment file systemd gives the daemon (EnvironmentFile=): serving.secrets' names.")
@click.option("--daemon-user", default=None,
              help="The user the daemon runs as (systemd User=), whose files are judged. [default: this user; as "
                   "root, spark, the shipped unit's]")
def doctor(file: str, as_json: bool, env_file: Path, daemon_user: str | None) -> None:
    """Check every node's prerequisites over the daemon's own SSH (kubeadm preflight): each check ok, warn or
    fail with what it saw and the exact fix. Changes nothing. Exit 0 all ok or warn, 1 a check failed, 2 invalid."""
    from reconciler.core.preflight import exit_code, report_json, report_text
    from reconciler.edge.doctor import doctor as run_checks

    desired = _load_or_exit(file)  # secrets come from --env-file, and loose file modes are checks, not refusals
    try:
        found = run_checks(desired, file, env_file, daemon_user)
    except KeyError:
        click.echo(printable(f"doctor: no user {daemon_user!r} on this host (--daemon-user)"), err=True)
        sys.exit(EXIT_INVALID)
    if as_json:
        click.echo(json.dumps(report_json(found), indent=2))
    else:
        click.echo(report_text(found), nl=False)
    sys.exit(exit_code(found))
