"""The `ui` blueprint: GET / serves the dashboard, a single page that polls the JSON APIs,
and its favicon (served here: the page loads nothing from a CDN)."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, render_template

bp = Blueprint("ui", __name__, template_folder="templates")


@bp.get("/")
def dashboard() -> str:
    # imported here: the registry brings gguf in, which the API needs nowhere else
    from runtime.registry import DEFAULT_MODEL

    # the playground starts on the model workers load first, not on the list's first
    return render_template("index.html", default_model=DEFAULT_MODEL)


@bp.get("/favicon.ico")
def favicon() -> Response:
    """Browsers ask for /favicon.ico whatever the page's <link rel="icon"> says; both are
    the app's static/favicon.svg."""
    return current_app.send_static_file("favicon.svg")
