"""An index on sessions.parent_id: listing a page of sessions reads their forks by parent (and a
deleted parent's forks are found by it when their parent_id is set to NULL), without a scan of
every session.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_sessions_parent_id", "sessions", ["parent_id"])


def downgrade() -> None:
    op.drop_index("ix_sessions_parent_id", table_name="sessions")
