"""Packed extents: content-addressed blobs of shuffled zstd frames.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("frames", sa.JSON(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("file_checksum", sa.String(32), nullable=False),
    )
    op.create_table(
        "extent_blobs",
        sa.Column("extent_id", sa.Integer(), sa.ForeignKey("extents.id"), primary_key=True),
        sa.Column("blob_hash", sa.String(64), sa.ForeignKey("blobs.hash"), nullable=False),
    )
    op.create_index("ix_extent_blobs_blob_hash", "extent_blobs", ["blob_hash"])


def downgrade() -> None:
    op.drop_table("extent_blobs")
    op.drop_table("blobs")
