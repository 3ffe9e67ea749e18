"""Latency and bandwidth of one TCP connection between two emulated hosts (run inside them).

    python netprobe.py serve PORT                 # echoes small messages, swallows large streams
    python netprobe.py latency HOST PORT [COUNT]  # prints the median one-way latency in us
    python netprobe.py stream HOST PORT BYTES     # prints the stream's rate in Gbit/s
"""

import socket
import statistics
import struct
import sys
import time


def serve(port):
    listener = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        connection, _ = listener.accept()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = connection.recv(1)
        if kind == b"L":  # echo 8-byte messages until the peer closes
            while True:
                message = _exactly(connection, 8)
                if not message:
                    break
                connection.sendall(message)
        elif kind == b"S":  # swallow a stream, then answer one byte
            remaining = struct.unpack("!Q", _exactly(connection, 8))[0]
            buffer = bytearray(1 << 20)
            while remaining:
                got = connection.recv_into(buffer, min(len(buffer), remaining))
                if not got:
                    break
                remaining -= got
            connection.sendall(b"k")
        connection.close()


def _exactly(connection, count):
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def latency(host, port, count=2000):
    connection = socket.create_connection((host, port))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connection.sendall(b"L")
    trips = []
    for _ in range(count):
        started = time.perf_counter()
        connection.sendall(b"12345678")
        _exactly(connection, 8)
        trips.append(time.perf_counter() - started)
    connection.close()
    return statistics.median(trips[count // 10:]) / 2 * 1e6


def stream(host, port, nbytes):
    connection = socket.create_connection((host, port))
    connection.sendall(b"S" + struct.pack("!Q", nbytes))
    chunk = memoryview(bytearray(1 << 20))
    started = time.perf_counter()
    remaining = nbytes
    while remaining:
        sent = connection.send(chunk[:min(len(chunk), remaining)])
        remaining -= sent
    connection.recv(1)
    seconds = time.perf_counter() - started
    connection.close()
    return nbytes * 8 / seconds / 1e9


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif sys.argv[1] == "latency":
        print(f"{latency(sys.argv[2], int(sys.argv[3]), *(int(a) for a in sys.argv[4:5])):.1f}")
    else:
        print(f"{stream(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])):.3f}")
