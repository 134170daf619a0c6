"""What the device protocol and the workflows share in one coordinator process.

Task wake-ups for long-polling devices, the tasks this process knows, model outlines, progress signals
and the hand-over of accepted updates to a run's driver. Both :mod:`fedlink.server.protocol` and
:mod:`fedlink.server.workflows` build on this layer; neither imports the other.
"""
