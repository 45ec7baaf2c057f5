from _softmax_impl import backward, softmax


def forward(inputs, scale):
    return softmax(inputs, scale)
