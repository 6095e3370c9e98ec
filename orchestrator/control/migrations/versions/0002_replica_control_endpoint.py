"""replicas.control_endpoint: the KV connector's flush endpoint.

Revision 0002, after 0001. Databases of this era may already have it (migrations/legacy.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from orchestrator.control.migrations.legacy import has_column

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if not has_column(op.get_bind(), "replicas", "control_endpoint"):
        with op.batch_alter_table("replicas") as batch:
            batch.add_column(sa.Column("control_endpoint", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("control_endpoint")
