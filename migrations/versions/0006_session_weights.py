"""How the session's model held its weight matrices (contract C6): "stored" (a GGUF file's quantized
blocks, multiplied by the integer kernels), "dense" (dequantized into the KV dtype) or "q8_0"
(quantized on load). Another way of holding them computes other bits, so a session continues only
under its own. Sessions from before were all made with dense weights.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("weights", sa.String(16), nullable=False, server_default="dense"))


def downgrade() -> None:
    op.drop_column("sessions", "weights")  # SQLite >= 3.35 drops it in place (a rebuild would cascade)
