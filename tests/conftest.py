"""Shared pytest settings."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "browser: needs a headless Chromium (Debian package 'chromium')")
