"""The exact prefix cache (contract C10): each session's chunk boundaries indexed by a chained
content hash (`prefix_keys`), how many of its leading positions hold a cold run's KV
(`sessions.n_reusable`), and the sessions kept only as prefix-cache entries (`prefix_entries`).

Existing sessions are not backfilled: they start with n_reusable 0 and no keys, so they are never a
prefix-cache hit. The index cannot tell how their KV was computed (which positions went through a
whole chunk call from position 0, with which kernels), and a key that claimed a cold run's KV where
it is not would make a reply differ from a cold run without any error. Sessions written after the
upgrade are indexed as their checkpoints commit.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("n_reusable", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "prefix_keys",
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("position", sa.Integer(), primary_key=True),
        sa.Column("key", sa.String(32), nullable=False))
    op.create_index("ix_prefix_keys_key", "prefix_keys", ["key"])
    op.create_table(
        "prefix_entries",
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("last_used", sa.DateTime(), nullable=False))
    op.create_index("ix_prefix_entries_last_used", "prefix_entries", ["last_used"])


def downgrade() -> None:
    op.drop_index("ix_prefix_entries_last_used", table_name="prefix_entries")
    op.drop_table("prefix_entries")
    op.drop_index("ix_prefix_keys_key", table_name="prefix_keys")
    op.drop_table("prefix_keys")
    op.drop_column("sessions", "n_reusable")  # SQLite >= 3.35 drops it in place (a rebuild would cascade)
