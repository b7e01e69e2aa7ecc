"""TextCraft (Minecraft crafting from text commands); importing this registers ``"textcraft"``."""

from environments.textcraft.env import INSTRUCTION, TextCraft

__all__ = ["INSTRUCTION", "TextCraft"]
