"""Reference pages made from the code, so that they cannot drift from it.

Two directives:

``tnt-settings``
    the table of every ``TNT_*`` setting, from ``tarantella.common.config.SETTINGS``.
``tnt-command`` *module:function*
    a command's usage and options, from the ``argparse`` parser that *function* builds
    (``tarantella.launcher.command_line:build_parser``, ``tarantella.timeline_picture:build_parser``).

Text with `backticks` in a setting's meaning or an option's help becomes inline code.
"""

import argparse
import importlib
import re

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def _inline(text):
    """A paragraph of `text`, with `code` spans as literals."""
    paragraph = nodes.paragraph()
    for index, part in enumerate(re.split(r"`([^`]*)`", text)):
        if part:
            paragraph += nodes.literal(part, part) if index % 2 else nodes.Text(part)
    return paragraph


def _table(header, rows, widths):
    table = nodes.table(classes=["tnt-generated"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    head += _row(header)
    body = nodes.tbody()
    group += body
    for cells in rows:
        body += _row(cells)
    return table


def _row(cells):
    row = nodes.row()
    for cell in cells:
        if isinstance(cell, nodes.entry):
            row += cell
            continue
        entry = nodes.entry()
        entry += cell if isinstance(cell, nodes.Node) else _inline(cell)
        row += entry
    return row


def _code(text):
    paragraph = nodes.paragraph()
    paragraph += nodes.literal(text, text)
    return paragraph


def _shown_default(setting):
    if setting.shown_default:
        return setting.shown_default
    if setting.type == "boolean":
        return "`true`" if setting.default else "`false`"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return f"`{int(setting.default)}`"
    return f"`{setting.default}`"


def _accepted(setting):
    if setting.type == "boolean":
        return "`true` or `false` (also 1/0, yes/no, on/off)"
    if setting.type == "choice":
        return " or ".join(f"`{choice}`" for choice in setting.choices)
    if setting.type == "number":
        return f"a finite number >= {setting.minimum:g}" + (f" ({setting.unit})" if setting.unit else "")
    if setting.type == "whole number":
        return f"a whole number >= {setting.minimum:g}"
    return {"file": "a file in an existing folder", "folder": "a folder", "command": "a command line"}[setting.type]


class SettingsTable(SphinxDirective):
    has_content = False

    def run(self):
        from tarantella.common import config
        self.env.note_dependency(config.__file__)
        rows = []
        for setting in config.SETTINGS.values():
            name = nodes.entry()
            name += _code(setting.name)
            if setting.flag:
                name += _inline(setting.flag if setting.flag.startswith("(") else f"option: `{setting.flag}`")
            meaning = nodes.entry()
            meaning += _inline(setting.meaning[:1].upper() + setting.meaning[1:] + "."
                               + (" The `tarantella` command sets it; leave it unset." if setting.set_by_command
                                  else ""))
            meaning += _inline(f"Accepted: {_accepted(setting)}.")
            rows.append([name, meaning, _shown_default(setting)])
        return [_table(["variable (and `tarantella` option)", "meaning", "default"], rows, [30, 52, 18])]


class CommandReference(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        module_name, function_name = self.arguments[0].split(":")
        module = importlib.import_module(module_name)
        self.env.note_dependency(module.__file__)
        parser = getattr(module, function_name)()
        usage = parser.format_usage().strip()
        if usage.startswith("usage: "):
            usage = usage[len("usage: "):]
        result = [nodes.literal_block(usage, usage, language="text")]
        for paragraph in (parser.description or "").strip().split("\n\n"):
            if paragraph.strip():
                result.append(_inline(" ".join(paragraph.split())))
        for group in parser._action_groups:
            actions = list(group._group_actions)
            if not actions:
                continue
            title = {"positional arguments": "arguments", "optional arguments": "options"}.get(group.title, group.title)
            title = re.sub(r"\s*\(docs/[^)]*\)", "", title)  # the --help text points into the docs; here we are
            result.append(nodes.rubric(title, title))
            result.append(_table(["option", "meaning"], [[_code(_spelling(action)), _help(action)]
                                                        for action in actions], [30, 70]))
        return result


def _spelling(action):
    if not action.option_strings:
        return action.metavar or action.dest
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    metavar = action.metavar or action.dest.upper()
    if action.choices:
        metavar = "{" + ",".join(action.choices) + "}"
    suffix = f" {metavar} [{metavar} ...]" if action.nargs == "+" else f" {metavar}"
    return ", ".join(action.option_strings) + suffix


def _help(action):
    text = action.help or ""
    if isinstance(action, argparse._VersionAction):
        text = "print the version and exit"
    elif isinstance(action, argparse._HelpAction):
        text = "print the options and exit"
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def setup(app):
    app.add_directive("tnt-settings", SettingsTable)
    app.add_directive("tnt-command", CommandReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
