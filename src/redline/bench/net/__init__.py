"""The network bench's two endpoints: a server (`redline bench network --serve`) and a client (`--connect`).

They speak a small protocol of their own over one TCP port (control and data connections, like iperf3's
5201) and the same UDP port (a loss probe): see wire.py.
"""
