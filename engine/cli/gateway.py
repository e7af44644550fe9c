"""``tidegate gateway``: one OpenAI-compatible endpoint before a fleet of replicas of any engine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tidegate.engine.cli.support import friendly
from tidegate.engine.gateway.routers import ROUTERS


class _GatewayError(Exception):
    """A setting the user can fix: no replica, a bad fleet file, a port in use."""


def _fleet_file(path: Path) -> list[str]:
    """The replica URLs of a fleet file: JSON ``{"replicas": ["http://...", ...]}`` or one URL a line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _GatewayError(f"the fleet file {str(path)!r} cannot be read ({exc.strerror or exc})") from None
    if text.lstrip().startswith("{"):
        try:
            urls = json.loads(text).get("replicas")
        except ValueError as exc:
            raise _GatewayError(f"the fleet file {str(path)!r} is not valid JSON ({exc})") from None
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise _GatewayError(f"the fleet file {str(path)!r} must hold \"replicas\": a list of URLs")
        return urls
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise _GatewayError(f"replica {url!r} is not an http:// or https:// URL")
    return url.rstrip("/")


@click.command()
@click.option("--replica", "replicas", multiple=True, metavar="URL",
              help="A replica's base URL, e.g. http://10.0.0.5:8000 (repeatable): any OpenAI-compatible server that "
                   "exports vLLM's, SGLang's or tidegate's load gauges on /metrics.")
@click.option("--fleet", "fleet_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A file of replica URLs: one a line, or JSON {\"replicas\": [...]}.")
@click.option("--router", type=click.Choice(list(ROUTERS)), default="predicted-delay", show_default=True,
              help="Which replica with room takes the next request (docs/GATEWAY.md).")
@click.option("--admission/--no-admission", default=True, show_default=True,
              help="Queue at the gateway until a replica has room, and answer 429 with Retry-After when the queue "
                   "would not start a request within the TTFT SLO; --no-admission dispatches every request at once "
                   "(a plain router).")
@click.option("--ttft-slo-s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="The time to first token admission promises.")
@click.option("--tpot-slo-s", type=click.FloatRange(min=0, min_open=True), default=0.2, show_default=True,
              help="The time per output token each replica's streams should see: a replica takes more of the "
                   "gateway's requests while its streams meet it, fewer when they do not.")
@click.option("--queue-ttl-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="A request that waits longer than this in the gateway queue ends with 503.")
@click.option("--scrape-interval-s", type=click.FloatRange(min=0.005), default=0.1, show_default=True,
              help="How often each replica's /metrics is read.")
@click.option("--stale-after-s", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Gauges older than this are stale; when every replica's are, the gateway dispatches on its own "
                   "counts (fail open, gauge tidegate:gateway_fail_open).")
@click.option("--health-interval-s", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="How often a replica that is down is checked on /health.")
@click.option("--read-timeout-s", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="The longest a replica may stay silent on a request before it is taken for gone.")
@click.option("--ejection-s", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="How long a replica that answers with server errors while the others do not is taken out "
                   "(times its ejections in a row, ten at most; 0: never).")
@click.option("--tenant-header", default="x-gateway-inference-fairness-id", show_default=True,
              help="The header naming a request's tenant; tenants share the queue by tokens.")
@click.option("--priority-header", default="x-gateway-inference-priority", show_default=True,
              help="The header giving a request's priority when its body has no 'priority' (lower goes first).")
@click.option("--priority-from", type=click.Choice(["body", "header", "none"]), default="body", show_default=True,
              help="Where a request's priority comes from: its body's 'priority', else the header (body); the header "
                   "alone, as a trusted proxy in front sets it, so that clients cannot jump the queue (header); "
                   "every request at 0 (none).")
@click.option("--admission-policy", type=click.Path(dir_okay=False), default=None,
              help="A fleet admission policy (ONNX: tidegate train --env fleet, then tidegate export) that sets "
                   "the admission budget every --policy-interval-s; default: the gateway's own rule.")
@click.option("--policy-interval-s", type=click.FloatRange(min=0.01), default=None,
              help="Seconds between the admission policy's decisions [default: half the TTFT SLO].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@friendly(_GatewayError)
def gateway(replicas, fleet_path, router, admission, ttft_slo_s, tpot_slo_s, queue_ttl_s, scrape_interval_s,
            stale_after_s, health_interval_s, read_timeout_s, ejection_s, tenant_header, priority_header,
            priority_from, admission_policy, policy_interval_s, host, port, log_level):
    """Admission, queueing, priorities and routing in front of many replicas of any engine."""
    import logging

    import uvicorn

    from tidegate.engine.gateway.app import create_gateway_app
    from tidegate.engine.gateway.fleet import GatewayConfig
    from tidegate.engine.serve.connections import http_protocol
    from tidegate.engine.serve.launch import KEEP_ALIVE_S, bind_sockets

    urls = [*replicas, *(_fleet_file(fleet_path) if fleet_path else [])]
    if not urls:
        raise _GatewayError("no replica: give --replica URL (repeatable) or --fleet FILE")
    urls = list(dict.fromkeys(_check_url(u) for u in urls))
    if admission_policy is not None:
        if not admission:
            raise _GatewayError("--admission-policy sets the gateway's admission: drop --no-admission")
        from tidegate.engine.gateway.features import load_fleet_policy

        try:
            load_fleet_policy(admission_policy)
        except ValueError as exc:
            raise _GatewayError(exc) from None
    config = GatewayConfig(urls, router=router, admission=admission, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                           queue_ttl_s=queue_ttl_s,
                           scrape_interval_s=scrape_interval_s, stale_after_s=stale_after_s,
                           health_interval_s=health_interval_s, read_timeout_s=read_timeout_s,
                           ejection_s=ejection_s,
                           tenant_header=tenant_header.lower(),
                           priority_header=priority_header.lower(), priority_from=priority_from,
                           admission_policy=admission_policy,
                           policy_interval_s=policy_interval_s, host=host, port=port)
    try:
        sockets = bind_sockets(host, port)
    except ValueError as exc:
        raise _GatewayError(exc) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape otherwise
    click.echo(f"tidegate: gateway on http://{host}:{port}/v1 before {len(urls)} replica(s) "
               f"({', '.join(urls)}), router {router}, admission {'on' if admission else 'off'}"
               f"{f', admission policy {admission_policy}' if admission_policy else ''}", err=True)
    server = uvicorn.Server(uvicorn.Config(create_gateway_app(config), log_level=log_level, access_log=False,
                                           timeout_keep_alive=KEEP_ALIVE_S, http=http_protocol(), ws="none"))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn may re-raise the Ctrl-C it shut down on: a stop asked for, not a failure
        pass
    click.echo("tidegate: gateway stopped", err=True)
