"""OpenAI's Responses and Conversations APIs (not written yet)."""

from fastapi import APIRouter

router = APIRouter()
