"""replicas.spec_revision (the launch revision a replica was launched from) and
services.update_mode (the update in progress, if any): rolling and blue-green updates.

Revision 0005, after 0004. Rows of older daemons get NULL: a replica of unknown revision is
taken to run the spec stored when the next update arrives (Daemon.apply_spec).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("spec_revision", sa.String(), nullable=True))
    with op.batch_alter_table("services") as batch:
        batch.add_column(sa.Column("update_mode", sa.String(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("services") as batch:
        batch.drop_column("update_mode")
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("spec_revision")
