"""Web navigation (WebArena's observation/action space in a real Chromium); importing this registers
``webarena``, ``webarena_local`` and ``miniwob``. See docs/web.md."""

from environments.web.env import EpisodeFailed, MiniWoB, WebArena, WebArenaLocal, WebEnv

__all__ = ["EpisodeFailed", "MiniWoB", "WebArena", "WebArenaLocal", "WebEnv"]
