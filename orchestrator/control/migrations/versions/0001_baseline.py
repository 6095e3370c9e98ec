"""Baseline: the first schema spot-orchestrator shipped (services, replicas, events, price
quotes, locations), as SQLModel's create_all made it.

Revision 0001, the first.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "services",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("spec_json", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("endpoint", sa.String(), nullable=True),
        sa.Column("lb_port", sa.Integer(), nullable=True),
        sa.Column("next_replica_index", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "replicas",
        sa.Column("replica_id", sa.String(), nullable=False),
        sa.Column("service", sa.String(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("cloud", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=False),
        sa.Column("zone", sa.String(), nullable=False),
        sa.Column("market", sa.String(), nullable=False),
        sa.Column("instance_type", sa.String(), nullable=True),
        sa.Column("instance_id", sa.String(), nullable=True),
        sa.Column("endpoint", sa.String(), nullable=True),
        sa.Column("agent_endpoint", sa.String(), nullable=True),
        sa.Column("price_per_hour", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("launched_at", sa.Float(), nullable=True),
        sa.Column("ready_at", sa.Float(), nullable=True),
        sa.Column("notice_deadline", sa.Float(), nullable=True),
        sa.Column("consecutive_probe_failures", sa.Integer(), nullable=False),
        sa.Column("first_probe_at", sa.Float(), nullable=True),
        sa.Column("last_probe_ok_at", sa.Float(), nullable=True),
        sa.Column("status_message", sa.String(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("replica_id"),
        sa.UniqueConstraint("service", "index", name="uq_replica_service_index"),
        sa.ForeignKeyConstraint(["service"], ["services.name"]),
    )
    op.create_index("ix_replicas_service", "replicas", ["service"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("service", sa.String(), nullable=True),
        sa.Column("replica_id", sa.String(), nullable=True),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("cloud", sa.String(), nullable=True),
        sa.Column("region", sa.String(), nullable=True),
        sa.Column("zone", sa.String(), nullable=True),
        sa.Column("market", sa.String(), nullable=True),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("data_json", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_events_at", "events", ["at"])
    op.create_index("ix_events_service_at", "events", ["service", "at"])
    op.create_table(
        "price_quotes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cloud", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=False),
        sa.Column("zone", sa.String(), nullable=False),
        sa.Column("instance_type", sa.String(), nullable=False),
        sa.Column("accelerator", sa.String(), nullable=False),
        sa.Column("accelerator_count", sa.Integer(), nullable=False),
        sa.Column("market", sa.String(), nullable=False),
        sa.Column("price_per_hour", sa.Float(), nullable=False),
        sa.Column("observed_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_price_quotes_lookup", "price_quotes", ["cloud", "zone", "instance_type", "observed_at"])
    op.create_table(
        "locations",
        sa.Column("cloud", sa.String(), nullable=False),
        sa.Column("region", sa.String(), nullable=False),
        sa.Column("zone", sa.String(), nullable=False),
        sa.Column("spot_price", sa.Float(), nullable=True),
        sa.Column("on_demand_price", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("cloud", "region", "zone"),
    )


def downgrade() -> None:
    for table in ("locations", "price_quotes", "events", "replicas", "services"):
        op.drop_table(table)
