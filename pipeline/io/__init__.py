"""The bottom layer: where inputs and stores live (`location`: a local path or an fsspec
URL as one `Location`, storage options and their secrets). `extract` reads the input and
`stores` writes the output through it; it imports nothing of bertpipe but `errors`."""
