"""A DeepSpeed script in the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, on ds_plugin.

The one change from a DeepSpeed script is the import line. Run it as DeepSpeed's launcher would:

    ds-plugin launch --num_gpus 2 examples/with_deepspeed/cifar_style.py --deepspeed \
        --deepspeed_config examples/with_deepspeed/ds_config.json

The data is a small synthetic stand-in for CIFAR-10 made here (3x16x16 images whose class is drawn into them as a
bright square, so nothing is downloaded and a small CNN learns it in a few epochs). The config is the example's own:
Adam and WarmupLR from the JSON, ZeRO-3.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import ds_plugin.deepspeed as deepspeed  # was: import deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR-style")
    parser.add_argument("-e", "--epochs", default=4, type=int, help="number of total epochs (default: 4)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=8, help="output logging information at a given interval")
    parser.add_argument("--save-dir", default="checkpoints", help="where engine.save_checkpoint writes")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticCIFAR(torch.utils.data.Dataset):
    """10 classes of 3x16x16 noise images; class k has a bright 4x4 square at position k and a tint of its own."""

    def __init__(self, size=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (size,), generator=g)
        self.images = torch.randn(size, 3, 16, 16, generator=g) * 0.5
        for i, k in enumerate(self.labels.tolist()):
            row, col = divmod(k, 4)
            self.images[i, k % 3, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4] += 2.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5, padding=2)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5, padding=2)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = SyntheticCIFAR()
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(  # noqa: RUF059 (as in the original)
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = model_engine.device
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if model_engine.local_rank == 0 and i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1: d}, {i + 1: 5d}] loss: {running_loss / args.log_interval: .3f}", flush=True)
                running_loss = 0.0
    model_engine.save_checkpoint(args.save_dir)
    print("Finished Training", flush=True)


if __name__ == "__main__":
    main()
