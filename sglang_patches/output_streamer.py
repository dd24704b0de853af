"""Hook on ``sglang.srt.managers.scheduler_components.output_streamer``.

- ``SchedulerOutputStreamer.is_request_level_customized_info_key`` (around): Flying's
  key (``REPORT_KEY``) in a request's ``customized_info`` is sent once per request (at
  its first streamed chunk, or when it finishes), not sliced per token: it carries where
  the request ran (``flying.session.report``) to ``meta_info`` with SGLang's own output.
"""

from __future__ import annotations

from flying.session.report import REPORT_KEY


def is_request_level_customized_info_key(original, streamer, key):
    return key == REPORT_KEY or original(streamer, key)
