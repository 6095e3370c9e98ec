"""services.incarnation: which `up` of the service its machines' tags name.

Revision 0004, after 0003. Databases of this era may already have it (migrations/legacy.py).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from orchestrator.control.migrations.legacy import has_column

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if not has_column(op.get_bind(), "services", "incarnation"):
        with op.batch_alter_table("services") as batch:
            # Existing rows need a value; '' is what they got before migrations too (a service
            # whose machines carry no incarnation). New rows always get one from the store.
            batch.add_column(sa.Column("incarnation", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.drop_column("incarnation")
