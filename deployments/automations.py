"""OmniFlow's automations: a notification when a run fails and when a run's validation reward regresses.

Declared with the deployments (`ensure_automations` is called when they are registered) and by `omniflow alerts
[--webhook URL]`. Both notify through one block, named `omniflow-alerts`, that the user configures:

- a `Webhook` block (the default): `ensure_automations(webhook_url)` / `omniflow alerts --webhook URL` / the
  `OMNIFLOW_ALERTS_WEBHOOK` variable create or update it (POST, JSON body); the automations call it with a JSON
  payload (`CallWebhook`);
- any notification block (Slack, Microsoft Teams, email, ...) saved under that name in the UI: the automations
  send it a subject and a text body (`SendNotification`).

Without such a block and without a URL nothing is created (there is nothing to notify).

| automation | trigger |
|---|---|
| `omniflow-run-failed` | Prefect's own state event of a `main_diffusion_v1` run entering a FAILED or CRASHED state (`prefect.flow-run.*`): emitted by the server, so it fires also when the run's process died without running its hooks |
| `omniflow-reward-regressed` | `omniflow.reward.regressed` (flows/events.py; `trainer.alerts.reward_regression_drop`) |

`ensure_automations` is idempotent: it creates or updates the automations by name.
"""

from __future__ import annotations

import os
from typing import Any
from uuid import UUID

BLOCK_NAME = "omniflow-alerts"
WEBHOOK_ENV = "OMNIFLOW_ALERTS_WEBHOOK"
FLOW_NAME = "main_diffusion_v1"
RUN_FAILED = "omniflow-run-failed"
REWARD_REGRESSED = "omniflow-reward-regressed"
REWARD_REGRESSED_EVENT = "omniflow.reward.regressed"  # flows/events.py REWARD_REGRESSED (not imported: it pulls the flow layer)

# Jinja templates, rendered by the server when an automation fires (`tojson` keeps the payloads valid JSON).
_RUN_FAILED_JSON = """{
  "alert": "omniflow-run-failed",
  "flow_run_id": {{ event.resource.id.split(".")[-1] | tojson }},
  "flow_run": {{ event.resource["prefect.resource.name"] | tojson }},
  "state": {{ event.resource["prefect.state-name"] | tojson }},
  "message": {{ event.resource["prefect.state-message"] | tojson }},
  "occurred": {{ event.occurred.isoformat() | tojson }}
}"""
_RUN_FAILED_TEXT = (
    'OmniFlow run {{ event.resource["prefect.resource.name"] }} ({{ event.resource.id }}) is '
    '{{ event.resource["prefect.state-name"] }}: {{ event.resource["prefect.state-message"] }}'
)
_REGRESSED_JSON = """{
  "alert": "omniflow-reward-regressed",
  "experiment": {{ event.resource["prefect.resource.name"] | tojson }},
  "run_id": {{ event.resource["omniflow.run-id"] | tojson }},
  "step": {{ event.payload.step | tojson }},
  "reward": {{ event.payload.reward | tojson }},
  "best": {{ event.payload.best | tojson }},
  "best_step": {{ event.payload.best_step | tojson }},
  "drop": {{ event.payload.drop | tojson }},
  "occurred": {{ event.occurred.isoformat() | tojson }}
}"""
_REGRESSED_TEXT = (
    'OmniFlow experiment {{ event.resource["prefect.resource.name"] }} (run {{ event.resource["omniflow.run-id"] }}): '
    "validation reward {{ event.payload.reward }} at step {{ event.payload.step }} is more than {{ event.payload.drop }} "
    "below the run's best {{ event.payload.best }} (step {{ event.payload.best_step }})"
)


def _triggers() -> dict[str, Any]:
    from prefect.automations import EventTrigger

    return {
        RUN_FAILED: EventTrigger(
            expect={"prefect.flow-run.*"},
            match={"prefect.resource.id": "prefect.flow-run.*", "prefect.state-type": ["FAILED", "CRASHED"]},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
            posture="Reactive",
            threshold=1,
        ),
        REWARD_REGRESSED: EventTrigger(
            expect={REWARD_REGRESSED_EVENT},
            match={"prefect.resource.id": "omniflow.experiment.*"},
            posture="Reactive",
            threshold=1,
        ),
    }


def _descriptions() -> dict[str, str]:
    return {
        RUN_FAILED: f"Notify {BLOCK_NAME} when a {FLOW_NAME} run fails or crashes.",
        REWARD_REGRESSED: f"Notify {BLOCK_NAME} when a run's validation reward falls below its best by more than "
        "trainer.alerts.reward_regression_drop.",
    }


def _find_block(client: Any) -> Any | None:
    """The block document named `BLOCK_NAME` (any block type), or None."""
    found = [d for d in client.read_block_documents(include_secrets=False) if d.name == BLOCK_NAME]
    return found[0] if found else None


def ensure_alert_block(client: Any, webhook_url: str | None = None) -> Any | None:
    """The `omniflow-alerts` block: a `Webhook` block saved (or updated) with `webhook_url` (else
    `$OMNIFLOW_ALERTS_WEBHOOK`) when one is given, else the block the user saved under that name, else None."""
    url = webhook_url or os.environ.get(WEBHOOK_ENV)
    if url:
        from prefect.blocks.webhook import Webhook

        existing = _find_block(client)
        if existing is not None and existing.block_type.slug != "webhook":
            raise ValueError(
                f"a {existing.block_type.name} block is already named {BLOCK_NAME!r}; the automations notify it. "
                f"To use the webhook {url} instead, delete that block first (prefect block delete "
                f"{existing.block_type.slug}/{BLOCK_NAME})"
            )
        Webhook(url=url, headers={"Content-Type": "application/json"}).save(BLOCK_NAME, overwrite=True)
    return _find_block(client)


def _actions(block: Any, name: str) -> list[Any]:
    from prefect.automations import CallWebhook, SendNotification

    json_payload, text = (_RUN_FAILED_JSON, _RUN_FAILED_TEXT) if name == RUN_FAILED else (_REGRESSED_JSON, _REGRESSED_TEXT)
    block_id = UUID(str(block.id))
    if block.block_type.slug == "webhook":
        return [CallWebhook(block_document_id=block_id, payload=json_payload)]
    if "notify" not in (block.block_schema.capabilities if block.block_schema else []):
        raise ValueError(
            f"the block {BLOCK_NAME!r} is a {block.block_type.name} block, which cannot notify; save a Webhook or a "
            "notification block (Slack, Microsoft Teams, email, ...) under that name"
        )
    return [SendNotification(block_document_id=block_id, subject=f"OmniFlow: {name}", body=text)]


def ensure_automations(webhook_url: str | None = None) -> list[str]:
    """Create or update (by name) OmniFlow's automations on the current Prefect API; returns their names.

    `webhook_url` (or `$OMNIFLOW_ALERTS_WEBHOOK`) saves the `omniflow-alerts` Webhook block first. Without a
    URL and without a block of that name, nothing is created and the result is empty.
    """
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        block = ensure_alert_block(client, webhook_url)
        if block is None:
            return []
        triggers, descriptions, names = _triggers(), _descriptions(), []
        for name, trigger in triggers.items():
            automation = AutomationCore(
                name=name, description=descriptions[name], enabled=True, trigger=trigger, actions=_actions(block, name)
            )
            existing = client.read_automations_by_name(name)
            if existing:
                client.update_automation(existing[0].id, automation)
                for duplicate in existing[1:]:  # a name is one automation
                    client.delete_automation(duplicate.id)
            else:
                client.create_automation(automation)
            names.append(name)
    return names
