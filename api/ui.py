"""The `ui` blueprint: GET / serves the dashboard, a single page that polls the JSON APIs."""

from __future__ import annotations

from flask import Blueprint, render_template

bp = Blueprint("ui", __name__, template_folder="templates")


@bp.get("/")
def dashboard() -> str:
    return render_template("index.html")
