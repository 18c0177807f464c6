"""Test support: an emulator of AITER's fused-MoE entry points (never a user backend)."""

from .emulator import AiterEmulator
from .sources import installed_contract, main_contract

__all__ = ["AiterEmulator", "installed_contract", "main_contract"]
