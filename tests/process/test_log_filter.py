"""TensorFlow's C++ log lines are filtered out; everything else passes."""

import io

from distributed_mpt.process.log_filter import _filter

TENSORFLOW_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1796061718.255367   27490 port.cc:153] oneDNN custom operations are on.\n",
    b"E0000 00:00:1796061719.918335   27490 cuda_platform.cc:52] failed call to cuInit: "
    b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n",
    b"W1130 18:00:01.123456  140 tf_logging.py:123] AutoGraph could not transform\n",
    b"To enable the following instructions: AVX512F FMA, in other operations, rebuild "
    b"TensorFlow with the appropriate compiler flags.\n",
    b"/job:worker/replica:0/task:1\n",
    # A mixed_float16 export predicted on a CPU without AVX-512 (an AVX2-only
    # AMD EPYC): its answers came after this line, an error to the eye.
    b"E0000 00:00:1796554065.268496    2606 util.cc:131] oneDNN supports DT_HALF only on "
    b"platforms with AVX-512. Falling back to the default Eigen-based implementation if "
    b"present.\n",
]
OURS = [
    b"error: --model_dir=/x is not writable (Permission denied)\n",
    b"step  10/100  epoch 0.50  loss 1.2\n",
    b"Traceback (most recent call last):\n",
    b"F0000 00:00:1796061719.918335   27490 check.cc:1] Check failed: a fatal line stays\n",
    b"E0000 00:00:1796061719.918335   27490 grpc_server_lib.cc:1] Could not start gRPC server\n",
]


def test_tensorflow_lines_are_dropped_and_the_rest_passes_in_order():
    sink = io.BytesIO()
    interleaved = [line for pair in zip(TENSORFLOW_LINES, OURS) for line in pair]
    lines = interleaved + TENSORFLOW_LINES[len(OURS):]
    _filter(io.BytesIO(b"".join(lines)), sink)
    assert sink.getvalue() == b"".join(OURS)


def test_progress_bars_pass_as_they_come_and_a_closed_sink_is_drained():
    class Source:
        """Hands out one chunk per read, as a pipe does."""
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def read1(self, size):
            return self.chunks.pop(0) if self.chunks else b""

    sink = io.BytesIO()
    _filter(Source([b"\rDl: 10%", b"\rDl: 20%\r", b"I0000 00:00:17.5 1 a.cc:1] x\n", b"tail"]),
            sink)
    assert sink.getvalue() == b"\rDl: 10%\rDl: 20%\rtail"

    class GoneSink:
        def write(self, data):
            raise BrokenPipeError

        def flush(self):
            pass

    source = Source([b"a\n", b"b\n", b"c\n"])
    _filter(source, GoneSink())  # returns, having read everything
    assert source.chunks == []


def test_an_ops_node_line_goes_with_its_warning_and_stays_in_a_traceback():
    node = b"\t [[{{function_node while_cond_1_true_412}}{{node while/cond_1/m_1/Assert}}]]\n"
    warning = (b"W0000 00:00:1796061720.1   27490 op_kernel.cc:1857] OP_REQUIRES failed at "
               b"assert_op.cc:39 : INVALID_ARGUMENT: assertion failed: [the batch must be even]\n")
    traceback = [b"tensorflow.python.framework.errors_impl.InvalidArgumentError: "
                 b"assertion failed: [the batch must be even]\n", node]
    sink = io.BytesIO()
    of_a_replica = b"\t [[Func/while/body/_1/while/cond_1/then/_175/input/_232/_40]]\n"
    _filter(io.BytesIO(b"".join([warning, node, of_a_replica, *traceback])), sink)
    assert sink.getvalue() == b"".join(traceback)


def test_a_python_traceback_in_an_unknown_ops_warning_goes_with_it_and_ours_stays():
    """A model's tf.numpy_function that raised: TensorFlow's warnings of the op
    and of the rendezvous carry its traceback, which came through under the
    run's one error line. The process's own traceback after a dropped line stays."""
    frames = [b"Traceback (most recent call last):\n", b"\n",
              b'  File "/x/script_ops.py", line 269, in __call__\n', b"    ret = func(*args)\n",
              b"          ^^^^^^^^^^^\n", b"\n", b"RuntimeError: counted out\n", b"\n", b"\n"]
    warnings = [b"W0000 00:00:1796600547.811213    9115 op_kernel.cc:1845] UNKNOWN: "
                b"RuntimeError: counted out\n", *frames,
                b"W0000 00:00:1796600547.812636    9115 local_rendezvous.cc:412] Local "
                b"rendezvous is aborting with status: UNKNOWN: RuntimeError: counted out\n",
                *frames, b"\t [[{{node while/cond_1/functional_1/counts_1/PyFunc}}]]\n"]
    ours = [b"error: --model=m.py:f failed in training steps 3-4 (UnknownError: ...)\n"]
    sink = io.BytesIO()
    _filter(io.BytesIO(b"".join([*warnings, *ours, TENSORFLOW_LINES[1], *frames[:1],
                                 frames[2], b"ValueError: ours\n"])), sink)
    assert sink.getvalue() == b"".join([*ours, frames[0], frames[2], b"ValueError: ours\n"])


def test_the_processs_own_traceback_right_after_an_unknown_ops_warning_stays():
    """Only the traceback a dropped UNKNOWN line carries goes, and only where the
    line names a Python exception: the process's own, printed right after,
    is all a user has of a failure that is the package's."""
    frames = [b"Traceback (most recent call last):\n",
              b'  File "/x/script_ops.py", line 269, in __call__\n', b"RuntimeError: counted out\n"]
    ours = [b"Traceback (most recent call last):\n", b'  File "/x/run.py", line 9, in run\n',
            b"tensorflow.python.framework.errors_impl.UnknownError: ours\n"]
    python = b"W0000 00:00:1796600547.811213    9115 op_kernel.cc:1845] UNKNOWN: RuntimeError: x\n"
    other = b"W0000 00:00:1796600547.811213    9115 op_kernel.cc:1845] UNKNOWN: Failed to x\n"
    for stream in ([python, *frames, *ours], [other, *ours]):
        sink = io.BytesIO()
        _filter(io.BytesIO(b"".join(stream)), sink)
        assert sink.getvalue() == b"".join(ours), stream
