"""The first schema: models, sessions, checkpoints, segments, extents, tokens, messages.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("fingerprint", sa.String(64), primary_key=True),
        sa.Column("arch", sa.String(32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False, unique=True),
        sa.Column("model_fingerprint", sa.String(64), sa.ForeignKey("models.fingerprint"), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("kv_layout", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("sampler", sa.JSON(), nullable=False),
        sa.Column("chunk_size", sa.Integer(), nullable=False),
        sa.Column("checkpoint_every", sa.Integer(), nullable=False),
        sa.Column("head", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("n_cached", sa.Integer(), nullable=False),
        sa.Column("active_call", sa.JSON(), nullable=True),
        sa.Column("parent_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="SET NULL"), nullable=True),
        sa.Column("fork_position", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("n_cached", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("session_id", "seq"),
    )
    op.create_index("ix_checkpoints_session_id", "checkpoints", ["session_id"])
    op.create_table(
        "segments",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("token_bytes", sa.Integer(), nullable=False),
        sa.Column("committed_end", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "extents",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("segment_id", sa.String(32), sa.ForeignKey("segments.id"), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("checksums", sa.JSON(), nullable=False),
    )
    op.create_index("ix_extents_segment_id", "extents", ["segment_id"])
    op.create_table(
        "session_extents",
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("start", sa.Integer(), primary_key=True),
        sa.Column("extent_id", sa.Integer(), sa.ForeignKey("extents.id"), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
    )
    op.create_index("ix_session_extents_extent_id", "session_extents", ["extent_id"])
    op.create_table(
        "token_blocks",
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("start", sa.Integer(), primary_key=True),
        sa.Column("ids", sa.LargeBinary(), nullable=False),
    )
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.String(32), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("ordinal", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_start", sa.Integer(), nullable=False),
        sa.Column("token_end", sa.Integer(), nullable=False),
        sa.UniqueConstraint("session_id", "ordinal"),
    )
    op.create_index("ix_messages_session_id", "messages", ["session_id"])


def downgrade() -> None:
    for table in ("messages", "token_blocks", "session_extents", "extents", "segments", "checkpoints",
                  "sessions", "models"):
        op.drop_table(table)
