"""The last token's final hidden state on the session row (contract C2 as amended): with it a
resume computes the next logits without feeding a token through the layers.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sessions", sa.Column("last_hidden", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    """Without the state, a session whose KV holds every token gets its last token pending again
    (the contract before 0004): the KV it uses ends one token earlier."""
    conn = op.get_bind()
    sessions = sa.table("sessions", sa.column("id"), sa.column("n_tokens"), sa.column("n_cached"))
    refs = sa.table("session_extents", sa.column("session_id"), sa.column("start"), sa.column("n_tokens"))
    full = conn.execute(sa.select(sessions.c.id, sessions.c.n_cached)
                        .where(sessions.c.n_cached == sessions.c.n_tokens, sessions.c.n_tokens > 0)).all()
    for session_id, n in full:
        last = conn.execute(sa.select(refs.c.start, refs.c.n_tokens).where(refs.c.session_id == session_id)
                            .order_by(refs.c.start.desc()).limit(1)).first()
        where = (refs.c.session_id == session_id) & (refs.c.start == last.start)
        conn.execute(sa.delete(refs).where(where) if last.n_tokens == 1
                     else sa.update(refs).where(where).values(n_tokens=last.n_tokens - 1))
        conn.execute(sa.update(sessions).where(sessions.c.id == session_id).values(n_cached=n - 1))
    op.drop_column("sessions", "last_hidden")  # SQLite >= 3.35 drops it in place (a rebuild would cascade)
