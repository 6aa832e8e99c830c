"""User-facing errors.

Every problem caused by input (a preset that does not exist, a malformed config, an impossible GPU layout)
raises a subclass of :class:`MemplanError`. The CLI catches them at one boundary and prints
``Error: <message>`` on one line with exit code 2; nothing else turns into a traceback for bad input.
"""


class MemplanError(Exception):
    """Bad input: the message is shown to the user as one line, exit code 2."""

    exit_code = 2


class ModelSourceError(MemplanError):
    """The model could not be resolved or read (preset, config.json, directory, cache, factory)."""


class ConfigError(MemplanError):
    """A config is present but malformed or missing a field the builder needs."""


class SettingsError(MemplanError):
    """A command-line or ds_config setting is invalid (sizes, GPU layout, unknown names)."""
