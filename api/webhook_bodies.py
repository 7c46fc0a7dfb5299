"""Pydantic models of the webhook admin bodies (`/admin/webhooks`), for the OpenAPI
document; the endpoints themselves are `workers.wire.webhooks.Endpoint`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from workers.wire.bodies import Body


class WebhookCreate(BaseModel):
    """`POST /admin/webhooks`."""

    url: str = Field(description="http or https; private addresses only if LLMQ_WEBHOOK_ALLOW")
    events: list[
        Literal[
            "response.completed",
            "response.failed",
            "response.cancelled",
            "response.incomplete",
            "batch.completed",
            "batch.failed",
            "batch.cancelled",
            "batch.expired",
        ]
    ]


class WebhookEndpoint(Body):
    id: str
    object: Literal["webhook_endpoint"]
    url: str
    events: list[str]
    created_at: int


class WebhookEndpointCreated(WebhookEndpoint):
    secret: str = Field(description="whsec_ + base64: shown only in this answer")


class WebhookEndpointList(Body):
    object: Literal["list"]
    data: list[WebhookEndpoint]


class WebhookEndpointDeleted(Body):
    id: str
    object: Literal["webhook_endpoint"]
    deleted: bool


class WebhookDelivery(Body):
    """One attempt: `status` the receiver's HTTP status (null when none came), `error` why
    it failed (null for a 2xx), `ms` how long it took, `at` when (Unix time)."""

    delivery: str
    event_id: str
    type: str
    attempt: int
    status: int | None
    error: str | None
    ms: float
    at: float


class WebhookDeliveryList(Body):
    object: Literal["list"]
    data: list[WebhookDelivery]


class DeadDelivery(Body):
    """A delivery that failed its last attempt (RQ's FailedJobRegistry of the webhook queue)."""

    delivery: str
    endpoint_id: str
    event_id: str
    type: str
    error: str | None
    failed_at: float | None


class DeadDeliveryList(Body):
    object: Literal["list"]
    data: list[DeadDelivery]


class Redelivered(Body):
    delivery: str
    object: Literal["webhook_delivery"]
    status: Literal["queued"]
