"""What the browser tests share: Debian's Chromium (never a downloaded browser) and screenshots."""

import os
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def shoot(page, name: str) -> None:
    """With HANGAR_SCREENSHOTS=DIR set, save the page as DIR/<name>.png (the README's pictures)."""
    if folder := os.environ.get("HANGAR_SCREENSHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=False)
