"""GET /openapi.json (OpenAPI 3.1, generated from the pydantic models) and GET /docs."""

from __future__ import annotations

import re

from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from api.openapi import ROUTES
from api.responses import Completion, Job, WorkerList

DOCUMENTED_PREFIXES = ("/v1", "/admin", "/health", "/ready", "/metrics", "/openapi.json")


def _flask_routes(app) -> set[tuple[str, str]]:
    routes = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        if not path.startswith(DOCUMENTED_PREFIXES):
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            routes.add((method.lower(), path))
    return routes


def test_document_is_valid_openapi_31(client) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on any violation of the 3.1 schema


def test_validator_does_refuse_a_broken_document(client) -> None:
    """The check above can fail: a path with an undeclared parameter is refused."""
    document = client.get("/openapi.json").get_json()
    document["paths"]["/v1/jobs/{job_id}"]["get"].pop("parameters")
    try:
        validate(document)
    except OpenAPIValidationError:
        return
    raise AssertionError("openapi-spec-validator accepted a path without its parameter")


def test_every_route_of_the_app_is_documented(app, client) -> None:
    document = client.get("/openapi.json").get_json()
    documented = {(m, p) for p, ops in document["paths"].items() for m in ops}
    served = _flask_routes(app)
    assert served - documented == set(), "routes the document misses"
    assert documented - served == set(), "operations the app does not serve"
    assert len(documented) == len(ROUTES)


def test_schemas_come_from_the_pydantic_models(client) -> None:
    document = client.get("/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    # nested models ($defs) moved into components, and every $ref resolves
    assert "ChatMessage" in schemas and "Tool" in schemas
    text = str(document)
    for name in re.findall(r"#/components/schemas/([A-Za-z0-9_]+)", text):
        assert name in schemas, name
    assert "$defs" not in text
    assert schemas["Job"]["properties"]["status"] == Job.model_json_schema()["properties"]["status"]
    assert set(Completion.model_fields) <= set(schemas["Completion"]["properties"])
    job = document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    assert job["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Job")
    assert job["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_admin_workers_documents_each_workers_device(client) -> None:
    """The body /admin/workers serves is what the document says, device included."""
    document = client.get("/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    workers = document["paths"]["/admin/workers"]["get"]["responses"]["200"]
    assert workers["content"]["application/json"]["schema"]["$ref"].endswith("/WorkerList")
    assert "device" in schemas["WorkerObject"]["required"]
    assert "device" in schemas["PoolEntryState"]["properties"]
    served = WorkerList.model_validate(client.get("/admin/workers").get_json())
    assert served.data[0].device == "cpu"


def test_docs_page_and_its_assets_are_served_locally(client) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert len(assets) == 4
    for asset in assets:
        assert asset.startswith("/docs/assets/"), f"{asset} is not served by the app"
        with client.get(asset) as response:  # a served file: closed when read
            assert response.status_code == 200, asset
            assert len(response.get_data()) > 0
    with client.get("/docs/assets/swagger-ui-bundle.js") as response:
        assert "SwaggerUIBundle" in response.get_data(as_text=True)
    assert "/openapi.json" in client.get("/docs/assets/init.js").get_data(as_text=True)
    assert client.get("/docs/assets/..%2Fsecret").status_code == 404
    assert client.get("/docs/assets/index.html").status_code == 404
