"""bootstrap_tokens: each VM's one-time boot credential (orchestrator.control.bootstrap).

Revision 0003, after 0002. Databases of this era may already have it (migrations/legacy.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from orchestrator.control.migrations.legacy import has_table

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if has_table(op.get_bind(), "bootstrap_tokens"):
        return
    op.create_table(
        "bootstrap_tokens",
        sa.Column("token_hash", sa.String(), nullable=False),
        sa.Column("service", sa.String(), nullable=False),
        sa.Column("replica_id", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("redeemed_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("token_hash"),
    )
    op.create_index("ix_bootstrap_tokens_service", "bootstrap_tokens", ["service"])
    op.create_index("ix_bootstrap_tokens_replica_id", "bootstrap_tokens", ["replica_id"])


def downgrade() -> None:
    op.drop_table("bootstrap_tokens")
