"""The web console (`outbox-relay console`): server-rendered pages over the operators' API, with
htmx (vendored) for the parts that refresh themselves. One Starlette application; the reads are
relay/postgres/browse.py, the writes Admin (keys) and relay/postgres/actions.py (bulk)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any
from uuid import UUID

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from relay.core import errors, filters
from relay.core.filters import DeadFilter
from relay.postgres import actions, browse
from relay.web import forms, security

_HERE = resources.files("relay.web")
#: The names a browser on this machine reaches an open (loopback, no login) console by.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    database_url: str
    schema: str = "outbox"
    pooled: bool = False
    read_only: bool = False
    access: security.Access = security.Access()  # noqa: RUF009 (frozen)
    refresh_seconds: int = 5


class Console:
    """The application's state: the database's readers and writers, what the login may do."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.browser = browse.Browser(config.database_url, config.schema, pooled=config.pooled)
        self.actions = actions.Actions(
            config.database_url, self.browser.count, config.schema, pooled=config.pooled
        )
        self.csrf = security.Csrf()
        self.rights = browse.Rights(False, False, False, False)

    @property
    def writes(self) -> bool:
        return self.rights.writes and not self.config.read_only

    def start(self) -> None:
        self.browser.open()
        self.rights = self.browser.rights()

    def stop(self) -> None:
        self.actions.stop()
        self.browser.close()


templates = Jinja2Templates(
    env=jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_HERE.joinpath("templates"))),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
)
Handler = Callable[[Request], Awaitable[Response]]


def _console(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def render(request: Request, name: str, code: int = 200, **context: Any) -> Response:
    console = _console(request)
    who = request.state.who
    base = {
        "who": who,
        "writes": console.writes,
        "read_only": console.config.read_only,
        "csrf": console.csrf.token(who),
        "refresh": console.config.refresh_seconds,
        "schema": console.config.schema,
    }
    response: Response = templates.TemplateResponse(request, name, base | context, status_code=code)
    return response


def problem(request: Request, status: int, message: str) -> Response:
    return render(request, "problem.html", status, message=message, status=status)


# Pages ------------------------------------------------------------------------------------------


async def healthz(request: Request) -> Response:
    """For probes: answers without a login, and says nothing but that it is up."""
    return PlainTextResponse("ok")


async def overview(request: Request) -> Response:
    data = await run_in_threadpool(_console(request).browser.overview)
    partial = request.headers.get("HX-Request") == "true"
    return render(request, "overview_live.html" if partial else "overview.html", data=data)


async def dead(request: Request) -> Response:
    query = forms.query(request.query_params)
    page = await run_in_threadpool(
        _console(request).browser.dead_page, query.search, before=query.before, limit=query.limit
    )
    return render(
        request,
        "dead.html",
        query=query,
        page=page,
        reasons=forms.REASONS,
        scan=filters.SEARCH_SCAN,
        described=list(forms.describe(query.search.where)),
    )


async def dead_row(request: Request) -> Response:
    try:
        dead_id = int(request.path_params["dead_id"])
    except ValueError:
        return problem(request, 404, "no such dead letter")
    browser = _console(request).browser
    row = await run_in_threadpool(browser.dead_row, dead_id)
    if row is None:
        return problem(request, 404, f"no dead letter {dead_id}: replayed or purged since?")
    kind, body = forms.body_view(row.body, row.properties)
    return render(request, "message.html", row=row, dead_id=dead_id, body_kind=kind, body=body)


async def whereabouts(request: Request) -> Response:
    try:
        message_id = UUID(request.query_params.get("message_id", ""))
    except ValueError:
        return problem(request, 400, "not a message id")
    places = await run_in_threadpool(_console(request).browser.whereabouts, message_id)
    return render(request, "whereabouts.html", message_id=message_id, places=places)


async def confirm(request: Request) -> Response:
    """Step one of a bulk action: what it will act on, counted, and one button to confirm."""
    form = await request.form()
    kind = _kind(form.get("kind"))
    where = _bulk_filter(form)
    browser = _console(request).browser
    upto = await run_in_threadpool(browser.last_dead)
    count = await run_in_threadpool(browser.count, where, upto)
    return render(
        request,
        "confirm.html",
        kind=kind,
        count=count,
        fields=[*forms.hidden_fields(where), ("upto", str(upto))],
        described=list(forms.describe(where)),
    )


async def act(request: Request) -> Response:
    form = await request.form()
    kind = _kind(form.get("kind"))
    where = _bulk_filter(form)
    upto = forms.position_id(form.get("upto"))
    console = _console(request)
    outcome = await run_in_threadpool(console.actions.start, kind, request.state.who, where, upto)
    if isinstance(outcome, actions.Started):
        return RedirectResponse(f"/actions/{outcome.action.id}", status_code=303)
    return render(request, "already.html", 409, outcome=outcome, kind=kind)


async def action_page(request: Request) -> Response:
    try:
        action_id = int(request.path_params["action_id"])
    except ValueError:
        return problem(request, 404, "no such action")
    action = await run_in_threadpool(_console(request).actions.get, action_id)
    if action is None:
        return problem(request, 404, f"no action {action_id}")
    partial = request.headers.get("HX-Request") == "true"
    return render(request, "action_live.html" if partial else "action.html", action=action)


async def action_list(request: Request) -> Response:
    recent = await run_in_threadpool(_console(request).actions.recent)
    return render(request, "actions.html", actions=recent)


async def keys(request: Request) -> Response:
    browser = _console(request).browser
    blocked = await run_in_threadpool(browser.blocked_keys)
    gated = await run_in_threadpool(browser.gated_keys)
    return render(request, "keys.html", blocked=blocked, gated=gated)


async def key_release(request: Request) -> Response:
    form = await request.form()
    key = forms.check_text("key", str(form.get("key", "")))
    mode = form.get("mode")
    if not key or mode not in ("replay", "skip"):
        raise errors.InvalidArgument("name a key, and replay or skip")

    def release() -> bool:
        with _console(request).browser.operator() as ops:
            return ops.release_key(key, replay=mode == "replay")

    released = await run_in_threadpool(release)
    return render(
        request, "released.html", 200 if released else 409, key=key, mode=mode, released=released
    )


def _kind(value: Any) -> actions.Kind:
    if value == "replay":
        return "replay"
    if value == "purge":
        return "purge"
    raise errors.InvalidArgument("the action must be replay or purge")


def _bulk_filter(form: Any) -> DeadFilter:
    search = forms.search(form)
    if not search.bulk_ok:
        raise errors.InvalidArgument(
            "a text search or an id's start selects rows to look at: act on the rows you "
            "select instead"
        )
    if form.get("scope") == "selected" and not search.where.message_ids:
        raise errors.InvalidArgument("select at least one row")
    return search.where


# The boundary: who asks, may they write, and every error as a page -----------------------------


def guarded(handler: Handler, *, write: bool = False) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            if write:
                denied = await _write_denied(request)
                if denied is not None:
                    return denied
            return await handler(request)
        except errors.InvalidArgument as exc:
            return problem(request, 400, str(exc))
        except errors.LockTimeout:
            return problem(request, 503, "the database is busy with these rows: try again")
        except errors.RelayError as exc:  # unavailable, a schema missing, refused
            return problem(request, 503, str(exc))

    return endpoint


async def _write_denied(request: Request) -> Response | None:
    console = _console(request)
    form = await request.form()
    token = form.get("csrf")
    if not console.csrf.valid(request.state.who, token if isinstance(token, str) else None):
        return problem(request, 403, "this form is out of date or not ours (CSRF): reload it")
    if not console.writes:
        why = "read-only mode" if console.config.read_only else "its database login reads only"
        return problem(request, 403, f"this console cannot change anything: {why}")
    return None


class Boundary:
    """ASGI middleware: 401 unless the asker is known, and the security headers on everything."""

    def __init__(self, app: Any, access: security.Access) -> None:
        self._app = app
        self._access = access

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        trusted = self._access.trusted_header
        who = await run_in_threadpool(
            self._access.who,
            headers.get("authorization"),
            headers.get(trusted.lower()) if trusted else None,
        )

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in security.HEADERS.items()]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        if who is None:
            challenge = [] if trusted else [(b"www-authenticate", b'Basic realm="outbox-relay"')]
            response = Response(
                "who are you? (401: this console asks for a login)",
                status_code=401,
                media_type="text/plain",
                headers={k.decode(): v.decode() for k, v in challenge},
            )
            await response(scope, receive, send_with_headers)
            return
        scope.setdefault("state", {})["who"] = who
        await self._app(scope, receive, send_with_headers)


def create_app(config: Config) -> Starlette:
    console = Console(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(console.start)
        try:
            yield
        finally:
            await run_in_threadpool(console.stop)

    routes = [
        Route("/healthz", healthz),
        Route("/", guarded(overview)),
        Route("/dead", guarded(dead)),
        Route("/dead/confirm", guarded(confirm, write=True), methods=["POST"]),
        Route("/dead/act", guarded(act, write=True), methods=["POST"]),
        Route("/dead/{dead_id}", guarded(dead_row)),
        Route("/where", guarded(whereabouts)),
        Route("/actions", guarded(action_list)),
        Route("/actions/{action_id}", guarded(action_page)),
        Route("/keys", guarded(keys)),
        Route("/keys/release", guarded(key_release, write=True), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(_HERE.joinpath("static"))), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.console = console
    app.add_middleware(Boundary, access=config.access)
    if config.access.open:
        # No login: only a browser on this machine that asked for this machine by name. A page
        # elsewhere that re-points its own name at 127.0.0.1 (DNS rebinding) gets a 400.
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK_NAMES))
    return app
