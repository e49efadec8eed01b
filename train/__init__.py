"""Lean ZeRO-3 trainer: validate -> plan -> load -> verify -> loop -> save."""
