"""The reference protocol as a pure state machine (no ray, torch, nixl, time, random, asyncio)."""
