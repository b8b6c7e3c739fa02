"""grpc's aio server logs an ERROR with a traceback when a handler ends after its caller has gone
(the batch that sends the status fails). setup_logging turns that record into one INFO line and
leaves every other failure of grpc's core as it was."""
from __future__ import annotations

import logging

import pytest
from grpc._cython.cygrpc import ExecuteBatchError

from specd.rpc.grpc_server import UndeliveredStatus

GRPC_LOGGER = "grpc._cython.cygrpc"
STATUS_NOT_SENT = 'Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation object at 0x7f1e>,)'
MESSAGE_NOT_SENT = 'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x7f1e>,)'


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def grpc_log():
    logger = logging.getLogger(GRPC_LOGGER)
    records, status_filter, level = Records(), UndeliveredStatus(), logger.level
    logger.addHandler(records)
    logger.addFilter(status_filter)
    yield logger, records.records
    logger.removeHandler(records)
    logger.removeFilter(status_filter)
    logger.setLevel(level)


def _log_raised(logger, error: Exception) -> None:
    try:
        raise error
    except ExecuteBatchError:
        logger.exception("ExecuteBatchError raised in core by servicer method [/specd.v1.Verifier/Generate]")


def test_a_status_the_caller_left_before_is_one_info_line(grpc_log):
    logger, records = grpc_log
    logger.setLevel(logging.INFO)
    _log_raised(logger, ExecuteBatchError(STATUS_NOT_SENT))
    (record,) = records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "Verifier/Generate" in record.getMessage() and "caller had gone" in record.getMessage()
    assert "Traceback" not in logging.Formatter().format(record)


def test_other_core_failures_keep_their_traceback(grpc_log):
    logger, records = grpc_log
    logger.setLevel(logging.INFO)
    _log_raised(logger, ExecuteBatchError(MESSAGE_NOT_SENT))
    (record,) = records
    assert record.levelno == logging.ERROR and "Traceback" in logging.Formatter().format(record)


def test_the_info_line_follows_the_log_level(grpc_log):
    logger, records = grpc_log
    logger.setLevel(logging.WARNING)
    _log_raised(logger, ExecuteBatchError(STATUS_NOT_SENT))
    assert records == []
